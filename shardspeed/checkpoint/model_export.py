"""The whole model in one state dict on rank 0: ``save_16bit_model`` and Accelerate's save.

``save_16bit_model`` and ``_zero3_consolidated_16bit_state_dict`` write one state dict from
rank 0, in the model's own names. Three layouts leave rank 0 without part of the model:

* ZeRO 3 and tensor parallelism shard parameters: ``engine.state_dict()`` gathers them
  (a collective on every rank);
* expert parallelism: rank 0 holds only its own ``num_local_experts`` experts, under local
  ids. Every rank renames its experts to global ids (as checkpoints store them,
  :mod:`shardspeed.checkpoint.expert_placement`) and sends them to rank 0, which writes the
  ``ep_size=1`` model holding every expert::

      ep 2, 4 experts:  rank 0 sends experts 0, 1 (local 0, 1)
                        rank 1 sends experts 2, 3 (local 0, 1 -> global 2, 3)

* pipeline parallelism: rank 0 holds stage 0's layers. The first replica of every other
  stage (data, sequence and tensor coordinate 0) sends its layers; their names are
  already global (``<layer index>.*``; a tied module under the same name on several
  stages is taken once, from the first stage that holds it).

Only one replica of each piece sends: ``expert_data`` rank 0 for an expert, the stage's
first replica for dense layers, and only what rank 0 lacks (a tie once). Descriptions go
through one ``gather_object``; the tensors stream to rank 0 one by one as bytes over
point-to-point ``send``/``recv`` (rank 0's peak: the whole model once, as in the file,
plus one tensor in flight).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from shardspeed import comm
from shardspeed.checkpoint.expert_placement import ExpertNames
from shardspeed.checkpoint.shards import trainable_ids


def export_state_dict(
    engine: Any, exclude_frozen_parameters: bool = False
) -> dict[str, torch.Tensor] | None:
    """The whole model as host tensors on rank 0 (None elsewhere); a collective call
    whenever the model is sharded over ranks (ZeRO 3, tensor, expert or pipeline axes)."""
    names = ExpertNames.of(engine.module)
    topology = engine.topology
    num_stages = topology.size("pipe")
    rank = comm.get_rank() if comm.is_initialized() else 0
    gathers = getattr(engine, "stage", 0) == 3 or topology.size("tensor") > 1
    if not (gathers or names.blocks or num_stages > 1) and rank != 0:
        return None
    source = engine.state_dict() if gathers else engine.module.state_dict()
    if exclude_frozen_parameters:
        trainable = trainable_ids(engine)
        frozen = {n for n, p in engine.module.named_parameters() if id(p) not in trainable}
        source = {k: v for k, v in source.items() if k not in frozen}
    if not names.blocks and num_stages == 1:
        return {k: _host(v) for k, v in source.items()} if rank == 0 else None

    first_replica = all(topology.rank_in(axis) == 0 for axis in ("data", "sequence", "tensor"))
    offer: dict[str, Any] = {}  # what this rank can send, in export names
    for key, value in source.items():
        if names.is_expert(key):
            if names.writes_replica(key, dp_rank=0):
                offer[names.global_name(key)] = value
        elif first_replica or rank == 0:
            offer[key] = value
    received = _stream_to_rank0(topology.stage_id, list(source), offer)
    if received is None:
        return None
    tensors, keys = received
    return _assemble(tensors, keys, names)


def _stream_to_rank0(
    stage: int, keys: list[str], offer: dict[str, Any]
) -> tuple[dict[str, Any], list[str]] | None:
    """Collective: rank 0 receives one copy of every offered entry, tensor by tensor.

    1. ``gather_object`` of each rank's (stage, state-dict keys, entry descriptions);
    2. rank 0 assigns each entry it lacks to the first rank offering it (stage order) and
       broadcasts the plan;
    3. each sender ``send``s its assigned tensors as bytes, rank 0 ``recv``s them into host
       tensors. Peak extra memory on rank 0: one tensor on the wire, not the whole model
       pickled per rank.
    Returns (entries, every stage's keys in stage order) on rank 0, None elsewhere.
    """
    rank, world = comm.get_rank(), comm.get_world_size()
    described = {k: _describe(v) for k, v in offer.items()} if rank != 0 else {}
    metas: list[Any] | None = [None] * world if rank == 0 else None
    dist.gather_object((stage, keys, described), metas, dst=0)
    plan: list[Any] = [None]
    if rank == 0:
        assert metas is not None
        claimed = set(offer)
        wanted: dict[int, list[str]] = {}
        for r in sorted(range(1, world), key=lambda r: (metas[r][0], r)):
            wanted[r] = [k for k in metas[r][2] if k not in claimed]
            claimed.update(wanted[r])
        plan = [wanted]
    dist.broadcast_object_list(plan, src=0)
    device = _wire_device()
    if rank != 0:
        for key in plan[0].get(rank, []):
            value = offer[key]
            if isinstance(value, torch.Tensor) and value.numel() > 0:
                dist.send(_as_bytes(value).to(device), dst=0)
        return None
    assert metas is not None
    tensors = {k: _host(v) for k, v in offer.items()}
    for r, wanted_keys in plan[0].items():
        for key in wanted_keys:
            kind, *info = metas[r][2][key]
            if kind == "value":
                tensors[key] = info[0]
                continue
            shape, dtype, nbytes = info
            buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
            if nbytes:
                dist.recv(buf, src=r)
            tensors[key] = buf.cpu().view(dtype).reshape(shape)
    order: dict[str, None] = {}
    for r in sorted(range(world), key=lambda r: (metas[r][0], r)):
        order.update(dict.fromkeys(metas[r][1]))
    return tensors, list(order)


def _describe(value: Any) -> tuple[Any, ...]:
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype, value.numel() * value.element_size())
    return ("value", value)


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s bytes as a flat uint8 tensor (any dtype, bool included, crosses gloo)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def _wire_device() -> torch.device:
    if "nccl" in str(dist.get_backend()).lower() and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _assemble(tensors: dict[str, Any], keys: list[str], names: ExpertNames) -> dict:
    """Rank 0: the entries in the model's key order (experts expanded to global ids)."""
    out: dict[str, Any] = {}
    for key in names.global_order(keys):
        if key not in tensors:
            raise RuntimeError(
                f"exporting the model: entry {key!r} came from no rank (a first replica of "
                f"every pipeline stage and an expert_data rank 0 of every expert must hold "
                f"it); received {len(tensors)} entries"
            )
        out[key] = tensors[key]
    return out


def _host(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True).contiguous()
    return value
