"""``PipelineModule``: a layer list cut into stages; each rank builds only its own layers.

Layer ``i`` is registered as submodule ``str(i)`` (its global index, as in DeepSpeed), so
parameter names are stable whatever the partition; tied modules live in
``tied_modules.<key>``. Layers pass one value to the next (a tensor or a tuple).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn as nn

from shardspeed.parallel.pipeline.instructions import Placement, locate_vstage, vstage_of
from shardspeed.parallel.pipeline.layers import LayerSpec, TiedLayerSpec, resolve_attr
from shardspeed.parallel.pipeline.partition import partition_layers
from shardspeed.parallel.pipeline.schedule import SCHEDULES, V_SHAPED, placement_of
from shardspeed.parallel.pipeline.topology import PipeDataParallelTopology, ProcessTopology
from shardspeed.topology import Topology
from shardspeed.utils.logging import get_logger, log_dist

logger = get_logger(__name__)


def _default_checkpoint_func(function: Callable[..., Any], *args: Any) -> Any:
    from shardspeed.runtime.activation_checkpointing import checkpoint

    return checkpoint(function, *args)


class PipelineModule(nn.Module):
    """A sequence of layers partitioned over pipeline stages (DeepSpeed's ``PipelineModule``).

    Args (DeepSpeed's):
        layers: modules, ``LayerSpec``/``TiedLayerSpec`` or callables, run in order.
        num_stages / topology: the number of stages, or a ``ProcessTopology`` (e.g.
            ``PipeDataParallelTopology(num_pp, num_dp)``) or a ``shardspeed.Topology``.
        loss_fn: ``loss_fn(outputs, labels)`` on the last stage; without it the last
            layer's output is the loss.
        seed_layers / seed_fn / base_seed: seed ``base_seed + layer_index`` (with
            ``seed_fn``, else ``torch.manual_seed``) before building each layer, so the
            weights do not depend on the partition.
        partition_method: ``"parameters"`` (balance trainable parameters), ``"uniform"``
            (balance layer count) or ``"type:<regex>"`` (balance layers whose class name
            matches).
        activation_checkpoint_interval / activation_checkpoint_func /
            checkpointable_layers: checkpoint every N layers with that function; only
            groups whose layers are all in ``checkpointable_layers`` (class names) when
            given, else groups holding parameters.
        dynamic_shape: re-negotiate activation shapes on every micro-batch.

    ShardSpeed additions (keyword-only; DeepSpeed has no equivalent):
        schedule: ``"1f1b"`` (default, DeepSpeed's TrainSchedule), ``"gpipe"``,
            ``"interleaved"``, or a zero-bubble schedule: ``"zb-h1"``, ``"zbv"``,
            ``"dualpipev"`` (:mod:`shardspeed.parallel.pipeline.schedule`).
        virtual_stages: model chunks per stage. ``"interleaved"`` takes ``>= 2``: the
            layers are cut into ``num_stages * virtual_stages`` parts and stage ``s``
            holds parts ``s, s + num_stages, ...``. ``"zbv"``/``"dualpipev"`` take 2
            (the default for them): stage ``s`` holds parts ``s`` and ``2 * num_stages -
            1 - s`` (a V: the first and the last part are on stage 0). Others take 1.
    """

    def __init__(
        self,
        layers: Sequence[Any] | nn.Sequential,
        num_stages: int | None = None,
        topology: ProcessTopology | Topology | None = None,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        seed_layers: bool = False,
        seed_fn: Callable[[int], Any] | None = None,
        base_seed: int = 1234,
        partition_method: str = "parameters",
        activation_checkpoint_interval: int = 0,
        activation_checkpoint_func: Callable[..., Any] = _default_checkpoint_func,
        checkpointable_layers: list[str] | None = None,
        dynamic_shape: bool = False,
        *,
        schedule: str = "1f1b",
        virtual_stages: int | None = None,
    ) -> None:
        super().__init__()
        self._layer_specs = list(layers)
        if not self._layer_specs:
            raise ValueError("PipelineModule(layers=[]): the layer list is empty.")
        if schedule not in SCHEDULES:
            raise ValueError(
                f"PipelineModule(schedule={schedule!r}) is not supported; allowed: "
                f"{', '.join(SCHEDULES)}."
            )
        if virtual_stages is None:
            virtual_stages = 2 if schedule in V_SHAPED else 1
        if not isinstance(virtual_stages, int) or virtual_stages < 1:
            raise ValueError(
                f"PipelineModule(virtual_stages={virtual_stages!r}): expected an int >= 1."
            )
        if schedule in V_SHAPED:
            if virtual_stages != 2:
                raise ValueError(
                    f"PipelineModule(schedule={schedule!r}, virtual_stages={virtual_stages}): "
                    "a V-shaped schedule holds exactly two chunks per stage; pass "
                    "virtual_stages=2 or leave it unset."
                )
        elif (schedule == "interleaved") != (virtual_stages > 1):
            raise ValueError(
                f"PipelineModule(schedule={schedule!r}, virtual_stages={virtual_stages}): "
                "virtual_stages > 1 goes with schedule='interleaved' and vice versa."
            )
        if activation_checkpoint_interval < 0:
            raise ValueError(
                f"activation_checkpoint_interval={activation_checkpoint_interval}: expected >= 0."
            )
        self._process_topology, self.shard_topology = self._resolve_topology(num_stages, topology)
        self.num_stages = self.shard_topology.pp
        self.stage_id = self.shard_topology.stage_id
        self.schedule = schedule
        self.virtual_stages = virtual_stages
        self.placement: Placement = placement_of(schedule)
        self.loss_fn = loss_fn
        self.seed_layers = seed_layers
        self.seed_fn = seed_fn
        self.base_seed = base_seed
        self.partition_method = partition_method
        self.activation_checkpoint_interval = activation_checkpoint_interval
        self.activation_checkpoint_func = activation_checkpoint_func
        self.checkpointable_layers = checkpointable_layers
        self.dynamic_shape = dynamic_shape

        num_parts = self.num_stages * virtual_stages
        self.parts = partition_layers(partition_method, self._layer_specs, num_parts)
        self.tied_modules = nn.ModuleDict()
        self.tied_weight_attrs: dict[str, list[str]] = {}
        self._chunk_funcs: list[list[Callable[[Any], Any]]] = []
        self._chunk_layer_indices: list[list[int]] = []
        for chunk in range(virtual_stages):
            vstage = self.vstage(chunk)
            indices = list(range(self.parts[vstage], self.parts[vstage + 1]))
            self._chunk_layer_indices.append(indices)
            self._chunk_funcs.append([self._build_layer(i) for i in indices])
        log_dist(
            f"PipelineModule: {len(self._layer_specs)} layers over {num_parts} parts "
            f"({partition_method}): boundaries {self.parts}",
            ranks=[0],
        )

    # -- construction ------------------------------------------------------------------
    @staticmethod
    def _resolve_topology(
        num_stages: int | None, topology: ProcessTopology | Topology | None
    ) -> tuple[ProcessTopology | None, Topology]:
        from shardspeed import comm

        if topology is None:
            if num_stages is None:
                raise ValueError(
                    "PipelineModule needs num_stages=<int> or topology=<ProcessTopology>; "
                    "got neither."
                )
            world = comm.get_world_size()
            if not comm.is_initialized() and num_stages != 1:
                raise ValueError(
                    f"PipelineModule(num_stages={num_stages}) needs torch.distributed: call "
                    "shardspeed.init_distributed() (and launch with the shardspeed launcher or "
                    "torchrun) before building the module."
                )
            if not isinstance(num_stages, int) or num_stages < 1 or world % num_stages:
                raise ValueError(
                    f"PipelineModule(num_stages={num_stages!r}): must be an int >= 1 that "
                    f"divides the world size {world}."
                )
            topology = PipeDataParallelTopology(num_pp=num_stages, num_dp=world // num_stages)
        if isinstance(topology, Topology):
            shard = topology
            process = None
        elif isinstance(topology, ProcessTopology):
            process, shard = topology, topology.to_topology()
        else:
            raise ValueError(
                f"PipelineModule(topology={topology!r}): expected a ProcessTopology "
                "(e.g. PipeDataParallelTopology) or a shardspeed.Topology."
            )
        if num_stages is not None and num_stages != shard.pp:
            raise ValueError(
                f"PipelineModule(num_stages={num_stages}) disagrees with the topology's "
                f"{shard.pp} pipeline stages; pass only one of them."
            )
        if process is not None and shard.world_size > 1 and not comm.is_initialized():
            raise ValueError(
                f"PipelineModule(topology={process!r}) needs torch.distributed to know this "
                "rank's stage: call shardspeed.init_distributed() before building the module "
                "(or pass a shardspeed.Topology with rank=...)."
            )
        if comm.is_initialized() and comm.get_world_size() != shard.world_size:
            raise ValueError(
                f"the pipeline topology covers {shard.world_size} ranks but the job has "
                f"{comm.get_world_size()}; build the topology from the launched world size."
            )
        return process, shard

    def _seed(self, layer_index: int) -> None:
        if not self.seed_layers:
            return
        seed = self.base_seed + layer_index
        if self.seed_fn is not None:
            self.seed_fn(seed)
        else:
            torch.manual_seed(seed)

    def _build_layer(self, index: int) -> Callable[[Any], Any]:
        layer = self._layer_specs[index]
        if isinstance(layer, TiedLayerSpec):
            if layer.key not in self.tied_modules:
                self._seed(index)
                self.tied_modules[layer.key] = layer.build()
                self.tied_weight_attrs[layer.key] = layer.tied_weight_attr
                for attr in layer.tied_weight_attr:
                    resolve_attr(self.tied_modules[layer.key], attr)  # validate early
            module = self.tied_modules[layer.key]
            if layer.forward_fn is None:
                return module
            return functools.partial(layer.forward_fn, module)
        if isinstance(layer, LayerSpec):
            self._seed(index)
            module = layer.build()
            self.add_module(str(index), module)
            return module
        if isinstance(layer, nn.Module):
            self.add_module(str(index), layer)
            return layer
        if callable(layer):
            return layer
        raise ValueError(
            f"PipelineModule layer {index} is a {type(layer).__name__}; expected an "
            "nn.Module, a LayerSpec/TiedLayerSpec or a callable."
        )

    # -- queries -----------------------------------------------------------------------
    def topology(self) -> ProcessTopology | Topology:
        """The topology passed in (or built from ``num_stages``)."""
        return self._process_topology or self.shard_topology

    @property
    def num_virtual_stages(self) -> int:
        return self.num_stages * self.virtual_stages

    def vstage(self, chunk: int) -> int:
        """The virtual stage (index of the layer part) that local ``chunk`` runs."""
        return vstage_of(self.stage_id, chunk, self.num_stages, self.placement)

    def stage_layer_indices(self, chunk: int = 0) -> list[int]:
        """Global indices of the layers of local ``chunk``."""
        return list(self._chunk_layer_indices[chunk])

    def stage_state(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """``state`` without the other stages' entries, for ``load_state_dict`` of a whole
        model's dict (every layer under its global index, as ``save_16bit_model`` writes):
        layer ``<i>.*`` entries of layers on other stages and ``tied_modules.<key>.*``
        entries of ties this stage does not hold are dropped; the rest is kept (so a
        missing entry of this stage's still fails a strict load)."""
        local = {str(i) for chunk in self._chunk_layer_indices for i in chunk}
        num_layers = len(self._layer_specs)
        out: dict[str, Any] = {}
        for key, value in state.items():
            head, _, rest = key.partition(".")
            if head.isdigit() and int(head) < num_layers and head not in local:
                continue  # another stage's layer
            if head == "tied_modules" and rest.partition(".")[0] not in self.tied_modules:
                continue  # a tie held by other stages only
            out[key] = value
        return out

    def tie_owners(self) -> dict[str, list[int]]:
        """For every tie key: the stages holding a layer with that key (ascending)."""
        owners: dict[str, set[int]] = {}
        for vstage in range(self.num_virtual_stages):
            for i in range(self.parts[vstage], self.parts[vstage + 1]):
                layer = self._layer_specs[i]
                if isinstance(layer, TiedLayerSpec):
                    stage = locate_vstage(vstage, self.num_stages, self.placement)[0]
                    owners.setdefault(layer.key, set()).add(stage)
        return {k: sorted(v) for k, v in sorted(owners.items())}

    def tied_parameters(self) -> dict[str, list[nn.Parameter]]:
        """For every tie key held here: its tied parameters (by ``tied_weight_attr``)."""
        return {
            key: [resolve_attr(self.tied_modules[key], a) for a in self.tied_weight_attrs[key]]
            for key in self.tied_modules
        }

    def replicated_parameters(self) -> list[nn.Parameter]:
        """Tied parameters whose owner is a lower stage: skipped in the global grad norm."""
        owners = self.tie_owners()
        tied = self.tied_parameters()
        return [
            p for key, params in tied.items() if owners[key][0] != self.stage_id for p in params
        ]

    # -- forward -----------------------------------------------------------------------
    def forward(self, inputs: Any, chunk: int = 0) -> Any:
        """Run local ``chunk``'s layers on ``inputs`` (a tensor or a tuple of tensors)."""
        funcs = self._chunk_funcs[chunk]
        interval = self.activation_checkpoint_interval
        if interval == 0 or not torch.is_grad_enabled():
            return _run(funcs, inputs)
        x = inputs
        for start in range(0, len(funcs), interval):
            group = funcs[start : start + interval]
            if self._is_checkpointable(group):
                args = x if isinstance(x, tuple) else (x,)
                x = self.activation_checkpoint_func(_Runner(group), *args)
            else:
                x = _run(group, x)
        return x

    def _is_checkpointable(self, funcs: list[Callable[[Any], Any]]) -> bool:
        modules = [f.args[0] if isinstance(f, functools.partial) else f for f in funcs]
        if self.checkpointable_layers is not None:
            return all(type(m).__name__ in self.checkpointable_layers for m in modules)
        return any(isinstance(m, nn.Module) and any(True for _ in m.parameters()) for m in modules)


def _run(funcs: Sequence[Callable[[Any], Any]], x: Any) -> Any:
    for f in funcs:
        x = f(x)
    return x


class _Runner:
    """Callable for checkpoint functions: ``_Runner(funcs)(*tensors)``."""

    def __init__(self, funcs: list[Callable[[Any], Any]]) -> None:
        self.funcs = funcs

    def __call__(self, *args: Any) -> Any:
        return _run(self.funcs, args[0] if len(args) == 1 else args)
