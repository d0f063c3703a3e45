"""ZeRO-3 parameter state as DeepSpeed users see it.

At stage 3 every trainable parameter belongs to one
:class:`~shardspeed.zero.flat_buffer.FlatGroup` with a gathered residency
(:class:`~shardspeed.zero.residency.GatheredResidency`): the parameters of one module
unit and one optimizer param group, of which this rank keeps slice ``rank``. Outside use
``param.data`` is empty and ``param.ds_status`` says so.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

import torch.nn as nn

if TYPE_CHECKING:
    from shardspeed.zero.flat_buffer import FlatGroup


class ZeroParamStatus(enum.Enum):
    """Whether a ZeRO-3 parameter's full data is present on this rank."""

    NOT_AVAILABLE = 1  # only the shard exists; ``param.data`` is empty
    INFLIGHT = 2  # an all-gather is running
    AVAILABLE = 3  # ``param.data`` is the full tensor


def owning_flat(param: nn.Parameter) -> FlatGroup | None:
    """The stage-3 flat group that manages ``param``, or None for an ordinary parameter."""
    return getattr(param, "_ss_flat", None)
