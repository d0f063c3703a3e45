"""Where each parameter's elements live in this rank's masters (checkpoints read this).

Every trainable parameter is a set of *fragments*: element ranges of the flattened
parameter held by one rank. The sharding layouts (stage 0-2 ``FlatGroup``, stage 3
``UnitGroup``) describe theirs as :class:`MasterFragment`; the checkpoint code stores and
reloads them by parameter name and global offset, so it never needs to know the stage.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from shardspeed.zero.partition import param_shard_fragments


@dataclass(frozen=True)
class MasterFragment:
    """Elements [start, start + length) of parameter ``name`` at ``local`` in ``master``.

    ``master`` is the tensor the optimizer keys its state by; ``writes`` is False where
    another rank saves the same elements (stage 0 replicas, a pipeline's tied copies).
    """

    name: str
    shape: list[int]
    start: int
    length: int
    master: torch.Tensor
    local: int
    writes: bool


@dataclass(frozen=True)
class ParamFragment:
    """Elements [start, start + length) of ``param`` (flattened), held by this rank at
    ``local`` in master ``master_index`` of its group; ``sharded``: other ranks hold
    other elements (False: every rank holds the whole parameter, stage 0)."""

    param: nn.Parameter
    shape: torch.Size
    start: int
    length: int
    master_index: int
    local: int
    sharded: bool


def param_fragments(group: Any) -> Iterator[ParamFragment]:
    """This rank's fragment of every parameter of a sharding group (``FlatGroup`` or
    ``UnitGroup``), from the layouts the group reports through ``layouts()``:
    ``(layout, rank, params, shapes, first master index)``, one bucket one master."""
    for layout, rank, params, shapes, base in group.layouts():
        for index, start, length, shard_offset in param_shard_fragments(layout, rank):
            bucket = layout.slots[index].bucket_index
            yield ParamFragment(
                params[index],
                shapes[index],
                start,
                length,
                base + bucket,
                shard_offset - layout.shard_offset(bucket),
                layout.shard_world_size > 1,
            )
