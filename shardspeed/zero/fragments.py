"""Where each parameter's elements live in this rank's masters (checkpoints read this).

Every trainable parameter is a set of *fragments*: element ranges of the flattened
parameter held by one rank. The sharding layouts (stage 0-2 ``FlatGroup``, stage 3
``UnitGroup``) describe theirs as :class:`MasterFragment`; the checkpoint code stores and
reloads them by parameter name and global offset, so it never needs to know the stage.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
