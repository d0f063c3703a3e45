"""One-file exports of expert-parallel models: every global expert gathered to rank 0.

``save_16bit_model`` and ``_zero3_consolidated_16bit_state_dict`` (Accelerate's save) write
one state dict from rank 0. With expert parallelism rank 0's module holds only its own
``num_local_experts`` experts, under local ids, so its state dict alone is a different,
smaller model. Here every rank renames its experts to global ids (as checkpoints store
them, :mod:`shardspeed.checkpoint.expert_placement`) and sends them to rank 0, which
writes the state dict of the ``ep_size=1`` model holding every expert::

    ep 2, 4 experts, 2 ranks:  rank 0 sends experts 0, 1 (local 0, 1)
                               rank 1 sends experts 2, 3 (local 0, 1 -> global 2, 3)
    rank 0 writes  dense..., ...deepspeed_experts.0..3.*, dense...  (global order)

Only ``expert_data`` rank 0 of each expert-parallel rank sends (the replicas are equal).
The tensors travel as pickled host copies through ``gather_object`` on the world group:
one collective, the same peak on rank 0 as the file it writes.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from shardspeed import comm
from shardspeed.checkpoint.expert_placement import ExpertNames


def gather_global_experts(
    state: dict[str, Any], names: ExpertNames
) -> dict[str, torch.Tensor] | None:
    """Collective over the world: rank 0 gets ``state`` with every global expert (names of
    an ``ep_size=1`` model, in global order, host copies); other ranks get None.

    ``state`` is each rank's full state dict in the module's own (local-expert) names:
    ``module.state_dict()`` or, at ZeRO 3 / with tensor parallelism, ``engine.state_dict()``.
    """
    mine = {
        names.global_name(key): _host(value)
        for key, value in state.items()
        if names.is_expert(key) and names.writes_replica(key, dp_rank=0)
    }
    rank = comm.get_rank()
    received: list[Any] | None = [None] * comm.get_world_size() if rank == 0 else None
    dist.gather_object(mine, received, dst=0)
    if rank != 0:
        return None
    experts: dict[str, torch.Tensor] = {}
    assert received is not None
    for part in received:
        experts.update(part)
    out: dict[str, torch.Tensor] = {}
    for key in names.global_order(list(state)):
        if key in experts:
            out[key] = experts[key]
        elif key in state and not names.is_expert(key):
            out[key] = _host(state[key])
        else:
            raise RuntimeError(
                f"exporting the expert-parallel model: global expert entry {key!r} came "
                "from no rank (an expert_data rank 0 must hold every expert); "
                f"received {len(experts)} expert tensors"
            )
    return out


def _host(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True).contiguous()
    return value
