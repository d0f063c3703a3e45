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
first replica for dense layers. The tensors travel as host copies through one
``gather_object`` on the world group (rank 0's peak: the whole model once, as in the file).
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
    mine: dict[str, Any] = {}
    for key, value in source.items():
        if names.is_expert(key):
            if names.writes_replica(key, dp_rank=0):
                mine[names.global_name(key)] = _host(value)
        elif first_replica or rank == 0:
            mine[key] = _host(value)
    received: list[Any] | None = [None] * comm.get_world_size() if rank == 0 else None
    dist.gather_object((topology.stage_id, list(source), mine), received, dst=0)
    if rank != 0:
        return None
    assert received is not None
    return _assemble(sorted(received, key=lambda part: part[0]), names)


def _assemble(parts: list[tuple[int, list[str], dict[str, Any]]], names: ExpertNames) -> dict:
    """Rank 0: every stage's keys in stage order (experts expanded to global ids)."""
    tensors: dict[str, Any] = {}
    local_keys: list[str] = []
    for _, keys, sent in parts:
        for key, value in sent.items():
            tensors.setdefault(key, value)  # a tied module: the first stage's copy
        local_keys += [k for k in keys if k not in local_keys]
    out: dict[str, Any] = {}
    for key in names.global_order(local_keys):
        if key not in tensors:
            raise RuntimeError(
                f"exporting the model: entry {key!r} came from no rank (a first replica of "
                f"every pipeline stage and an expert_data rank 0 of every expert must hold "
                f"it); received {len(tensors)} tensors"
            )
        out[key] = tensors[key]
    return out


def _host(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True).contiguous()
    return value
