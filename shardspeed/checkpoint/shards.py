"""Tensor fragments of a checkpoint: what each rank writes, and how a rank refills its shard.

Every trainable parameter is stored as the fragments its owners hold (one per owning rank,
flattened), named by parameter name, kind (``master`` or an optimizer state key such as
``exp_avg``) and the element range [start, end) of the flattened parameter. Loading maps
this rank's fragments of the *new* layout (each sharding group's ``master_fragments``,
see :mod:`shardspeed.zero.fragments`) onto the stored ranges, so any world size and any
stage 0-3 loads any other. Tensor-parallel parameters are stored per tensor rank and
resharded across tensor-parallel degrees (:mod:`shardspeed.checkpoint.tp_placement`).
MoE experts are stored under their global expert ids and reloaded at any expert-parallel
degree (:mod:`shardspeed.checkpoint.expert_placement`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from shardspeed.checkpoint.expert_placement import ExpertNames
from shardspeed.checkpoint.format import (
    KIND_BUFFER,
    KIND_MASTER,
    KIND_PARAM,
    NON_OPTIMIZER_KINDS,
    dtype_from_name,
    dtype_name,
    overlapping,
    tensor_key,
)
from shardspeed.checkpoint.integrity import inside, unreadable_file
from shardspeed.checkpoint.tp_placement import LocalReader, Placement, read_full
from shardspeed.zero.fragments import MasterFragment, param_fragments


def param_names(module: nn.Module) -> dict[int, str]:
    """``id(param) -> name`` (the first name of a tied parameter)."""
    return {id(p): n for n, p in module.named_parameters()}


def tied_aliases(module: nn.Module) -> dict[str, str]:
    """``alias -> canonical name`` for parameters registered under several names."""
    canonical = param_names(module)
    return {
        n: canonical[id(p)]
        for n, p in module.named_parameters(remove_duplicate=False)
        if canonical[id(p)] != n
    }


def tensor_rank(engine: Any) -> int:
    """This rank's coordinate on the engine's tensor axis (0 without tensor parallelism)."""
    topology = getattr(engine, "topology", None)
    return topology.rank_in("tensor") if topology is not None else 0


def master_fragments(engine: Any) -> Iterator[tuple[MasterFragment, Placement | None]]:
    """This rank's master fragments, as the engine's sharding layout places them, each with
    its tensor-parallel placement (None: the parameter is whole on every tensor rank).

    A fragment's ``shape``/``start`` are in the local tensor: this rank's shard of a
    tensor-parallel parameter."""
    names = param_names(engine.module)
    experts = ExpertNames.of(engine.module)
    replicated = _replicated_ids(engine)
    t_rank = tensor_rank(engine)
    for group in engine.flat_groups:
        for f in param_fragments(group):
            placement = Placement.of(f.param, t_rank)
            name = names[id(f.param)]
            # stage 0 replicas: data rank 0 (expert_data rank 0 for an expert) writes;
            # parameters replicated over the tensor axis: tensor rank 0; a pipeline's tied
            # copies: another stage
            owner = f.sharded or experts.writes_replica(name, engine.dp_rank)
            owner = owner and (placement is not None or t_rank == 0)
            yield (
                MasterFragment(
                    name=experts.global_name(name),
                    shape=list(f.shape),
                    start=f.start,
                    length=f.length,
                    master=group.masters[f.master_index],
                    local=f.local,
                    writes=owner and id(f.param) not in replicated,
                ),
                placement,
            )


def _replicated_ids(engine: Any) -> set[int]:
    """Parameters another stage saves (a pipeline's tied copies): loaded, never written.

    An engine opts in with ``checkpoint_replicated_params()``.
    """
    hook = getattr(engine, "checkpoint_replicated_params", None)
    return {id(p) for p in hook()} if hook is not None else set()


def trainable_ids(engine: Any) -> set[int]:
    """ids of the parameters the engine trains (the rest are saved whole as frozen)."""
    return {id(p) for g in engine.flat_groups for p in g.params}


def _is_elementwise_state(value: Any, master: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and value.numel() == master.numel() > 1


class FragmentWriter:
    """Collects one rank's tensors (flattened host copies) and their metadata entries.

    With ``copy`` (the default) every tensor is copied, so the snapshot stays valid while
    training goes on (async save); without it host tensors are only flattened. Device tensors go to pinned host memory with non-blocking copies; call
    :meth:`synchronize` before using the copies.
    """

    def __init__(self, copy: bool = True) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.entries: list[dict[str, Any]] = []
        self.copy = copy  # False: host tensors are referenced (written before training resumes)
        self._devices: set[torch.device] = set()

    def _host_copy(self, data: torch.Tensor) -> torch.Tensor:
        flat = data.detach().reshape(-1)
        if flat.device.type != "cuda":
            return flat.to("cpu", copy=self.copy).contiguous()
        host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
        host.copy_(flat, non_blocking=True)
        self._devices.add(flat.device)
        return host

    def synchronize(self) -> None:
        """Wait for the pending device-to-host copies."""
        for device in self._devices:
            torch.cuda.synchronize(device)
        self._devices.clear()

    def add(
        self,
        name: str,
        kind: str,
        shape: list[int],
        start: int,
        data: torch.Tensor,
        placement: Placement | None = None,
    ) -> None:
        """Store ``data`` as elements [start, ...) of flattened ``name`` of local ``shape``
        (with ``placement``: of this tensor rank's shard; the entry gets the full shape)."""
        tp_rank = None if placement is None else placement.rank
        key = tensor_key(name, kind, start, start + data.numel(), tp_rank)
        self.tensors[key] = self._host_copy(data)
        entry = {
            "key": key,
            "name": name,
            "kind": kind,
            "shape": shape if placement is None else placement.full_shape(shape),
            "start": start,
            "end": start + data.numel(),
            "dtype": dtype_name(data.dtype),
        }
        if placement is not None:
            entry["tp"] = placement.to_json(shape)
        self.entries.append(entry)


def _scalar_state(value: Any, master: torch.Tensor) -> dict[str, Any]:
    if isinstance(value, torch.Tensor):
        return {
            "value": value.item(),
            "dtype": dtype_name(value.dtype),
            "on_param_device": value.device == master.device and master.device.type != "cpu",
        }
    return {"value": value}


def optimizer_state_access(engine: Any, *, write: bool) -> contextlib.AbstractContextManager:
    """Masters and optimizer state readable (with ``write``: writable) inside the block.

    A no-op unless the optimizer swaps them to NVMe (``offload_optimizer.device: nvme``):
    then its ``state_resident(write)`` reads them into host memory for the block and, with
    ``write``, stores them back (and into the parameter shards) on exit.
    """
    hook = getattr(engine.optimizer, "state_resident", None)
    return hook(write=write) if hook is not None else contextlib.nullcontext()


def collect_fragments(engine: Any, writer: FragmentWriter, *, exclude_frozen: bool) -> list[Any]:
    """Add this rank's master/optimizer-state fragments (+ frozen/buffers on dp rank 0).

    Returns the scalar optimizer state per flat group (e.g. Adam's ``step``) as JSON.
    """
    with optimizer_state_access(engine, write=False):
        return _collect_fragments(engine, writer, exclude_frozen=exclude_frozen)


def _collect_fragments(engine: Any, writer: FragmentWriter, *, exclude_frozen: bool) -> list[Any]:
    opt = engine.basic_optimizer
    scalars: list[dict[str, Any]] = []
    for group in engine.flat_groups:
        group_scalars: dict[str, Any] = {}
        for master in group.masters:
            state = opt.state.get(master, {}) if opt is not None else {}
            for k, v in state.items():
                if not _is_elementwise_state(v, master):
                    group_scalars.setdefault(k, _scalar_state(v, master))
        scalars.append(group_scalars)
    for frag, placement in master_fragments(engine):
        if not frag.writes:
            continue
        sources = {KIND_MASTER: frag.master}
        if opt is not None:
            for k, v in opt.state.get(frag.master, {}).items():
                if _is_elementwise_state(v, frag.master):
                    sources[k] = v
        for kind, src in sources.items():
            piece = src.reshape(-1)[frag.local : frag.local + frag.length]
            writer.add(frag.name, kind, frag.shape, frag.start, piece, placement)
    # whole tensors: data rank 0 of each pipeline stage (expert_data rank 0 of each expert's
    # ep rank) writes them; duplicates are dropped by the index
    experts = ExpertNames.of(engine.module)
    t_rank = tensor_rank(engine)
    trainable = trainable_ids(engine)
    if not exclude_frozen:
        for name, p in engine.module.named_parameters():
            placement = Placement.of(p, t_rank)
            if id(p) in trainable or not experts.writes_replica(name, engine.dp_rank):
                continue
            if placement is not None or t_rank == 0:
                writer.add(experts.global_name(name), KIND_PARAM, list(p.shape), 0, p, placement)
    if t_rank == 0:  # buffers are whole on every tensor rank
        for name, b in persistent_buffers(engine.module).items():
            if experts.writes_replica(name, engine.dp_rank):
                writer.add(experts.global_name(name), KIND_BUFFER, list(b.shape), 0, b)
    return scalars


def persistent_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    keys = set(module.state_dict().keys())
    return {n: b for n, b in module.named_buffers() if n in keys}


class SliceReader:
    """Opens rank files lazily and reads element ranges of stored 1-D tensors."""

    def __init__(self, tag_dir: Path) -> None:
        self.tag_dir = tag_dir
        self._handles: dict[str, Any] = {}

    def read(self, file: str, key: str, lo: int, hi: int) -> torch.Tensor:
        from safetensors import safe_open

        handle = self._handles.get(file)
        if handle is None:
            path = inside(self.tag_dir, file, "checkpoint file")
            try:
                handle = safe_open(str(path), framework="pt", device="cpu")
            except Exception as err:  # SafetensorError, OSError: name the file, no traceback
                raise unreadable_file(path, err) from None
            self._handles[file] = handle
        stored = handle.get_slice(key)
        if not stored.get_shape():  # a 0-dim tensor (e.g. a scalar in client_state): whole
            return handle.get_tensor(key)
        return stored[lo:hi]

    def fill(self, dest: torch.Tensor, pieces: list[list[Any]], start: int, what: str) -> None:
        """Fill flat ``dest`` with elements [start, start + dest.numel()) of the stored tensor."""
        covered = 0
        for file, key, lo, hi, offset in overlapping(pieces, start, start + dest.numel()):
            dest[offset : offset + hi - lo].copy_(self.read(file, key, lo, hi))
            covered += hi - lo
        if covered != dest.numel():
            raise ValueError(
                f"checkpoint covers {covered} of the {dest.numel()} elements of {what} at "
                f"[{start}, {start + dest.numel()}); the checkpoint is incomplete or corrupt."
            )

    def dtype(self, entry: dict[str, Any]) -> torch.dtype:
        return dtype_from_name(entry["dtype"])

    def full(self, entry: dict[str, Any], kind: str, name: str) -> torch.Tensor:
        """The whole stored tensor (a tensor-parallel one assembled from its shards)."""
        if "tp" in entry:
            return read_full(self, entry, kind, name)
        numel = 1
        for d in entry["shape"]:
            numel *= d
        out = torch.empty(numel, dtype=self.dtype(entry))
        self.fill(out, entry["kinds"][kind], 0, f"{name} ({kind})")
        return out.view(entry["shape"])


def _restore_scalar(saved: dict[str, Any], master: torch.Tensor) -> Any:
    if "dtype" not in saved:
        return saved["value"]
    device = master.device if saved.get("on_param_device") else torch.device("cpu")
    return torch.tensor(saved["value"], dtype=dtype_from_name(saved["dtype"]), device=device)


def load_fragments(
    engine: Any,
    reader: SliceReader,
    manifest: dict[str, Any],
    *,
    optimizer_states: bool,
    strict: bool,
) -> None:
    """Refill this rank's masters (and optimizer state) from any saved layout."""
    with optimizer_state_access(engine, write=True):
        _load_fragments(engine, reader, manifest, optimizer_states=optimizer_states, strict=strict)


def _load_fragments(
    engine: Any,
    reader: SliceReader,
    manifest: dict[str, Any],
    *,
    optimizer_states: bool,
    strict: bool,
) -> None:
    index = manifest["index"]
    opt = engine.basic_optimizer if optimizer_states else None
    kinds = sorted({k for e in index.values() for k in e["kinds"]} - NON_OPTIMIZER_KINDS)
    fragments = list(master_fragments(engine))
    # state kinds per master: param groups may differ (Muon: momentum; its AdamW half: moments)
    master_kinds: dict[int, set[str]] = {
        id(m): set() for g in engine.flat_groups for m in g.masters
    }
    for frag, _ in fragments:
        if frag.name in index:
            master_kinds[id(frag.master)] |= set(index[frag.name]["kinds"]) - NON_OPTIMIZER_KINDS
    states: dict[int, dict[str, torch.Tensor]] = {
        id(m): {k: torch.zeros_like(m) for k in sorted(master_kinds[id(m)])}
        for g in engine.flat_groups
        for m in g.masters
    }
    local = LocalReader(reader)  # reshards tensor-parallel parameters when the split differs
    for frag, placement in fragments:
        entry = index.get(frag.name)
        if entry is None or KIND_MASTER not in entry["kinds"]:
            raise ValueError(
                f"checkpoint has no master weights for trainable parameter {frag.name!r}; it "
                "was saved from a different model. Load the matching model or use "
                "get_fp32_state_dict_from_checkpoint and load_state_dict(strict=False)."
            )
        shape = frag.shape if placement is None else placement.full_shape(frag.shape)
        if list(entry["shape"]) != shape:
            raise ValueError(
                f"parameter {frag.name!r} has (full) shape {shape} but the checkpoint stores "
                f"{entry['shape']}; the model architecture differs from the saved one."
            )
        span = slice(frag.local, frag.local + frag.length)
        with torch.no_grad():
            dest = frag.master.view(-1)[span]
            local.fill(dest, entry, KIND_MASTER, frag.name, frag.start, placement)
            if opt is None:
                continue
            for kind in sorted(master_kinds[id(frag.master)]):
                if kind not in entry["kinds"]:
                    raise ValueError(f"checkpoint lacks optimizer state {kind!r} of {frag.name!r}")
                dest = states[id(frag.master)][kind].view(-1)[span]
                local.fill(dest, entry, kind, frag.name, frag.start, placement)
    saved_scalars = manifest.get("optimizer_scalars", [])
    for g_idx, group in enumerate(engine.flat_groups if opt is not None else []):
        scalars = saved_scalars[g_idx] if g_idx < len(saved_scalars) else {}
        if not (kinds or scalars):
            continue  # saved before the first optimizer step
        for master in group.masters:
            opt.state[master] = {
                **{k: _restore_scalar(v, master) for k, v in scalars.items()},
                **states[id(master)],
            }
    _load_full_tensors(engine, reader, index, strict=strict)


def _load_full_tensors(
    engine: Any, reader: SliceReader, index: dict[str, Any], *, strict: bool
) -> None:
    trainable = trainable_ids(engine)
    targets = {
        n: (p, KIND_PARAM) for n, p in engine.module.named_parameters() if id(p) not in trainable
    }
    targets.update({n: (b, KIND_BUFFER) for n, b in persistent_buffers(engine.module).items()})
    missing = []
    local, t_rank = LocalReader(reader), tensor_rank(engine)
    experts = ExpertNames.of(engine.module)
    for name, (tensor, kind) in targets.items():
        entry = index.get(experts.global_name(name))
        if entry is None or kind not in entry["kinds"]:
            missing.append(name)
            continue
        with torch.no_grad():
            tensor.copy_(local.tensor(entry, kind, name, Placement.of(tensor, t_rank)))
    if missing and strict:
        raise ValueError(
            f"checkpoint lacks frozen parameters/buffers {missing}; it was saved with "
            "exclude_frozen_parameters=True or from another model. Pass "
            "load_module_strict=False to keep their current values."
        )
