"""The collective-sequence check: every N optimizer steps, do all ranks agree?

:class:`CollectiveSequenceCheck` is built once by the engine (from the ``collective_check``
config block or ``SHARDSPEED_COLLECTIVE_CHECK``) and called at every optimizer-step
boundary. When enabled it starts the process-wide recorder
(:data:`shardspeed.comm.sequence.SEQUENCE`); every ``interval`` steps it all-reduces
``[count, fingerprint, -count, -fingerprint]`` (max) over the group, which tells every rank
at once whether all agree. On a mismatch the ranks all-gather their bounded histories and
every rank raises the same :class:`~shardspeed.comm.errors.CollectiveMismatchError`,
naming per rank the first divergent collective and the few before it. The check's own
collectives are not recorded.

It catches divergences that do not deadlock: ranks that reduce different modules'
tensors of the same size (silently mixing data), or that take different branches which
happen to pair up. A divergence that deadlocks surfaces as a collective timeout instead
(see :mod:`shardspeed.comm.errors`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from shardspeed.comm.errors import CollectiveMismatchError
from shardspeed.comm.sequence import (
    DEFAULT_HISTORY,
    SEQUENCE,
    first_divergence,
    format_divergence,
    format_ranks,
    group_ranks,
)
from shardspeed.utils.logging import get_logger, log_dist

logger = get_logger(__name__)

CHECK_ENV = "SHARDSPEED_COLLECTIVE_CHECK"
CHECK_TAG = "collective_check"


@dataclass(frozen=True)
class CheckSettings:
    """Resolved settings: config block, then the environment override."""

    enabled: bool = False
    interval: int = 50
    history: int = DEFAULT_HISTORY

    @classmethod
    def resolve(cls, config: Any, environ: Mapping[str, str]) -> CheckSettings:
        """From a ``CollectiveCheckConfig`` (or None) and ``SHARDSPEED_COLLECTIVE_CHECK``."""
        enabled = bool(getattr(config, "enabled", False))
        interval = int(getattr(config, "interval", 50))
        history = int(getattr(config, "history", DEFAULT_HISTORY))
        text = environ.get(CHECK_ENV, "").strip()
        if text:
            try:
                value = int(text)
            except ValueError:
                value = -1
            if value < 0:
                raise ValueError(
                    f"environment variable {CHECK_ENV}={text!r} must be a non-negative integer: "
                    "the check interval in optimizer steps (0 turns the check off)."
                )
            enabled, interval = value > 0, max(value, 1)
        return cls(enabled, interval, history)


class CollectiveSequenceCheck:
    """Compares this rank's collective sequence with its group's every ``interval`` steps."""

    def __init__(self, settings: CheckSettings, group: Any, device: torch.device) -> None:
        import torch.distributed as dist

        self.group = group
        self.device = device
        self.interval = settings.interval
        size = dist.get_world_size(group) if dist.is_initialized() else 1
        self.enabled = settings.enabled and size > 1
        if self.enabled:
            SEQUENCE.start(settings.history)
            log_dist(
                f"collective_check: comparing collective sequences over ranks "
                f"{format_ranks(group_ranks(group))} every {self.interval} optimizer steps"
            )

    @classmethod
    def from_config(
        cls,
        config: Any,
        group: Any,
        device: torch.device,
        environ: Mapping[str, str] | None = None,
    ) -> CollectiveSequenceCheck:
        """Build from the ``collective_check`` block (None: off unless the env var says so)."""
        settings = CheckSettings.resolve(config, os.environ if environ is None else environ)
        return cls(settings, group, device)

    def step_boundary(self, step: int) -> None:
        """Called after every optimizer step; checks on every ``interval``-th (a collective)."""
        if self.enabled and step % self.interval == 0:
            self.check(step)

    def check(self, step: int | None = None) -> None:
        """Compare now (every rank of the group must call it); raises on a mismatch."""
        import torch.distributed as dist

        from shardspeed.comm.collectives import ReduceOp, all_gather_object, all_reduce
        from shardspeed.comm.logger import set_current_tag

        with SEQUENCE.paused(), set_current_tag(CHECK_TAG):
            count, fingerprint = SEQUENCE.count, SEQUENCE.fingerprint
            both = torch.tensor(
                [count, fingerprint, -count, -fingerprint], dtype=torch.int64, device=self.device
            )
            all_reduce(both, op=ReduceOp.MAX, group=self.group)
            hi_count, hi_fp, lo_count, lo_fp = (int(x) for x in both.tolist())
            if hi_count == -lo_count and hi_fp == -lo_fp:
                SEQUENCE.mark_verified()
                return
            rank = dist.get_rank()
            snapshots: list[Any] = [None] * dist.get_world_size(self.group)
            all_gather_object(snapshots, SEQUENCE.snapshot(rank), group=self.group)
        divergence = first_divergence(snapshots)
        at = f"optimizer step {step}" if step is not None else "an explicit check"
        head = (
            f"collective sequences diverged across ranks {format_ranks(group_ranks(self.group))} "
            f"(found at {at}; checked every {self.interval} steps; this is rank "
            f"{dist.get_rank()})."
        )
        body = format_divergence(divergence) if divergence is not None else ""
        raise CollectiveMismatchError(
            f"{head}\n{body}\nEvery rank must issue the same collectives (op, group, size, "
            "dtype, module) in the same order. Look for a data-dependent branch around the "
            "module named above: run it on every rank (e.g. with a zero-weight dummy input) "
            "or move the collective out of the branch."
        )
