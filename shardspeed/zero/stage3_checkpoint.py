"""Checkpoint plumbing of the ZeRO-3 engine: its master fragments and parameter refresh.

The checkpoint code (:mod:`shardspeed.checkpoint.shards`) stores every trainable parameter
as name-keyed element ranges of its fp32 master. At stage 3 each :class:`ShardedFlat`
holds one padded bucket sharded over the dp group, so this rank's fragments are the
pieces of the flat's parameters that fall into slice ``flat.rank``; they are yielded
as :class:`~shardspeed.checkpoint.shards.MasterFragment` in the engine's fixed flat
order (every unit's flats, then the persistent flat, per optimizer param group).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from shardspeed.zero.partition import param_shard_fragments


def stage3_master_fragments(engine: Any) -> Iterator[Any]:
    """Yield this rank's :class:`MasterFragment` of every stage-3 flat (persistent included)."""
    from shardspeed.checkpoint.shards import MasterFragment, param_names

    names = param_names(engine.module)
    for group in engine.flat_groups:
        for flat in group.flats:
            writes = flat.layout.shard_world_size > 1 or engine.dp_rank == 0
            base = flat.layout.shard_offset(0)
            for p_idx, p_start, length, shard_off in param_shard_fragments(flat.layout, flat.rank):
                param = flat.params[p_idx]
                yield MasterFragment(
                    name=names[id(param)],
                    shape=list(param.ds_shape),
                    start=p_start,
                    length=length,
                    master=flat.master,
                    local=shard_off - base,
                    writes=writes,
                )


@torch.no_grad()
def stage3_publish_params(engine: Any) -> None:
    """After masters were overwritten (checkpoint load): refresh shards and gathered copies.

    Same as the stage-3 optimizer's ``_publish_params`` for an engine without optimizer.
    """
    if engine.optimizer is not None:
        engine.optimizer._publish_params()
        return
    for group in engine.flat_groups:
        group.copy_masters_to_params()
    engine.coordinator.release_all()
    for flat in engine.persistent_flats:
        flat.release()
        flat.gather()
