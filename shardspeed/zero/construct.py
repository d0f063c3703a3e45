"""``zero.Init``: partition every module's parameters as soon as the module is constructed.

Inside the context, when a module's outermost ``__init__`` returns
(:mod:`shardspeed.zero.module_patches` wraps the constructors), the module's directly owned
parameters are broadcast from data-parallel rank 0 (so every rank holds the same values
whatever its random state) and split into 1/N pieces
(:mod:`shardspeed.zero.init_partition`). A model built of many modules therefore never
holds more than one module's parameters whole. ``torch.nn.init`` functions called on a
partitioned parameter (``self.apply(self._init_weights)`` in a parent) run on a temporary
full tensor, giving the same values as a construction without the context.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn as nn

from shardspeed import comm
from shardspeed.utils.logging import get_logger, warning_once
from shardspeed.zero.init_partition import InitPartition, is_init_partitioned, partition_param
from shardspeed.zero.module_patches import PATCHES, paused

__all__ = ["Init", "paused"]

logger = get_logger(__name__)


class Init(contextlib.ContextDecorator):
    """Construct modules with their parameters partitioned over the data-parallel group.

    ``with zero.Init(config_dict_or_path=ds_config): model = MyModel()`` builds the model
    with every parameter split 1/N as soon as the module that owns it is constructed, so
    no rank holds the whole model; ``shardspeed.initialize`` (stage 3) then adopts the
    pieces. ``zero.Init(module=model)`` partitions an existing module. The context can be
    nested (the innermost one's settings apply) and used as a decorator.

    Args:
        module: an already-built module to partition now.
        data_parallel_group: the group to split over (default: the world, or ``mpu``'s
            data-parallel group). It should be the engine's data-parallel group.
        mem_efficient_linear: accepted for compatibility; no effect (ShardSpeed gathers
            parameters in module hooks, so ``F.linear`` needs no special autograd function).
        remote_device: where the pieces live until ``initialize``: None (the accelerator,
            or the CPU without one) or ``"cpu"``. Default: the config's
            ``zero_optimization.offload_param.device`` when set, else None.
        pin_memory: page-lock CPU pieces (when CUDA exists).
        config_dict_or_path: a ds_config (dict, JSON path or base64 string); its fp16/bf16
            block sets the stored dtype.
        config: deprecated alias of ``config_dict_or_path``.
        enabled: False makes the whole context a no-op.
        dtype: the stored dtype of floating-point parameters. Default: the config's
            fp16/bf16 block (fp32 for a config with neither), else the constructed dtype.
        mpu: a Megatron-style object whose ``get_data_parallel_group()`` gives the group.

        zero_quantized_weights: ZeRO++ qwZ for these parameters: the engine's stage-3
            weight all-gathers of them are int8-quantized, as with the config's
            ``zero_optimization.zero_quantized_weights`` (DeepSpeed ORs the two). Gathers
            made before ``initialize`` (``GatheredParameters``) stay exact.

    ``zero_param_parallel_group``, ``sequence_data_parallel_group``,
    ``zero_quantized_nontrainable_weights`` and ``param_swapper`` (NVMe) are not supported
    and raise ``ValueError``.
    """

    def __init__(
        self,
        module: nn.Module | None = None,
        data_parallel_group: Any = None,
        mem_efficient_linear: bool = True,
        remote_device: str | None = None,
        pin_memory: bool = False,
        config_dict_or_path: Any = None,
        config: Any = None,
        enabled: bool = True,
        dtype: torch.dtype | str | None = None,
        mpu: Any = None,
        zero_param_parallel_group: Any = None,
        zero_quantized_weights: bool = False,
        zero_quantized_nontrainable_weights: bool = False,
        sequence_data_parallel_group: Any = None,
        param_swapper: Any = None,
    ) -> None:
        self.enabled = enabled
        if not enabled:
            return
        _reject_unsupported(
            zero_param_parallel_group=zero_param_parallel_group,
            sequence_data_parallel_group=sequence_data_parallel_group,
            zero_quantized_nontrainable_weights=zero_quantized_nontrainable_weights,
            param_swapper=param_swapper,
        )
        if config is not None:
            warning_once("zero.Init(config=...) is deprecated; use config_dict_or_path=...")
        cfg = _load_config(config_dict_or_path if config_dict_or_path is not None else config)
        self.dtype = _resolve_dtype(dtype, cfg)
        zero_cfg = getattr(cfg, "zero_optimization", None)
        self.quantized_weights = bool(zero_quantized_weights) or bool(
            getattr(zero_cfg, "zero_quantized_weights", False)
        )
        self.remote_device, self.pin_memory = _resolve_remote(remote_device, pin_memory, cfg)
        if not comm.is_initialized():
            comm.init_distributed()
        self.group = data_parallel_group
        if self.group is None and mpu is not None:
            self.group = mpu.get_data_parallel_group()
        self.world = comm.get_world_size(group=self.group)
        self.rank = comm.get_rank(group=self.group)
        from shardspeed.accelerator import get_accelerator
        from shardspeed.zero.grad_reduction import backend_of

        self.compute_device = get_accelerator().device(comm.get_local_rank())
        self.comm_device = self.compute_device
        if backend_of(self.group) != "nccl":
            self.comm_device = torch.device("cpu")
        if module is not None:
            self.partition_tree(module)

    # -- context protocol -----------------------------------------------------------------
    def __enter__(self) -> Init:
        if self.enabled:
            PATCHES.push(self)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.enabled:
            PATCHES.pop(self)

    # -- partitioning ---------------------------------------------------------------------
    def partition_tree(self, module: nn.Module) -> None:
        """Partition every parameter of an existing ``module`` (one submodule at a time)."""
        for sub in module.modules():
            self.partition_module(sub)

    @torch.no_grad()
    def partition_module(self, module: nn.Module) -> None:
        """Broadcast ``module``'s own parameters from dp rank 0 and keep this rank's pieces."""
        seen: set[int] = set()
        for name, param in module._parameters.items():  # noqa: SLF001 - directly owned only
            if param is None or id(param) in seen or not self._needs_partition(param):
                continue
            seen.add(id(param))
            lazy = isinstance(param, nn.parameter.UninitializedParameter)
            if lazy or param.device.type == "meta":
                warning_once(
                    f"zero.Init: parameter {type(module).__name__}.{name} is "
                    f"{'uninitialized (lazy)' if lazy else 'on the meta device'} and is left "
                    "unpartitioned; materialise it before shardspeed.initialize()."
                )
                continue
            full = param.data.to(self.comm_device)
            if self.world > 1:
                comm.broadcast(full, src=self._src(), group=self.group)
            state = InitPartition(
                group=self.group,
                world=self.world,
                rank=self.rank,
                comm_device=self.comm_device,
                init_device=param.device,
                init_dtype=param.dtype,
                quantized_weights=self.quantized_weights,
            )
            dtype = self.dtype if self.dtype is not None and param.is_floating_point() else None
            partition_param(
                param,
                full,
                state,
                ds_id=next(PATCHES.ids),
                piece_dtype=dtype or param.dtype,
                piece_device=self.remote_device or self.compute_device,
                pin_memory=self.pin_memory,
                compute_device=self.compute_device,
            )

    @staticmethod
    def _needs_partition(param: nn.Parameter) -> bool:
        # already partitioned (a tie to an earlier module) or already managed by an engine
        return not is_init_partitioned(param) and getattr(param, "_ss_flat", None) is None

    def _src(self) -> int:
        if self.group is None:
            return 0
        return torch.distributed.get_global_rank(self.group, 0)


def _reject_unsupported(**options: Any) -> None:
    for name, value in options.items():
        if value is None or value is False:
            continue
        if name == "param_swapper":
            fix = "remove it; NVMe parameter offload is configured through offload_param"
        elif name.endswith("group"):
            fix = "remove it; parameters are partitioned over the data-parallel group"
        else:
            fix = "remove it (frozen weights stored quantized are not implemented)"
        raise ValueError(f"zero.Init({name}={value!r}) is not supported by ShardSpeed; {fix}.")


def _load_config(source: Any) -> Any:
    if source is None:
        return None
    from shardspeed.config import load_config

    # only the blocks read here: the rest may hold "auto" values the HF Trainer fills later
    return load_config(source, sections=("fp16", "bf16", "zero_optimization"))


def _resolve_dtype(dtype: torch.dtype | str | None, cfg: Any) -> torch.dtype | None:
    from shardspeed.precision.policy import parse_dtype

    if dtype is not None:
        resolved = parse_dtype(dtype, "zero.Init(dtype)")
        if resolved is None or not resolved.is_floating_point:
            raise ValueError(
                f"zero.Init(dtype={dtype!r}) must be a floating-point dtype: torch.float32, "
                "torch.float16 or torch.bfloat16."
            )
        return resolved
    if cfg is None:
        return None
    if cfg.fp16.enabled:
        return torch.float16
    if cfg.bf16.enabled:
        return torch.bfloat16
    return torch.float32


def _resolve_remote(
    remote_device: str | None, pin_memory: bool, cfg: Any
) -> tuple[torch.device | None, bool]:
    offload = cfg.zero_optimization.offload_param if cfg is not None else None
    if remote_device is None and offload is not None and offload.device != "none":
        if offload.device == "nvme":
            logger.info(
                "zero.Init: offload_param.device='nvme' in the config; pieces are kept in "
                "host memory during construction."
            )
        return torch.device("cpu"), bool(offload.pin_memory) or pin_memory
    if remote_device is None or remote_device == "none":
        return None, pin_memory
    if remote_device == "cpu":
        return torch.device("cpu"), pin_memory
    if remote_device == "nvme":
        raise ValueError(
            "zero.Init(remote_device='nvme') is not supported: pieces are kept in host or "
            "device memory until shardspeed.initialize(). Use remote_device='cpu' (or None), and "
            "configure NVMe parameter offload with zero_optimization.offload_param in the config."
        )
    raise ValueError(
        f"zero.Init(remote_device={remote_device!r}) is not supported; allowed: None "
        "(the accelerator), 'cpu'."
    )
