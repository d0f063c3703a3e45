"""Gradient reduction that overlaps with backward: one reducer for every ZeRO stage.

The reducer works on *slots*: a slot is one collective's worth of gradients (a bucket of
a :class:`~shardspeed.zero.flat_buffer.FlatGroup`, or a part of one; a stage-3 unit's
flat is one bucket: :mod:`shardspeed.zero.flat_slot`). A post-accumulate-grad hook on every
trainable parameter marks it ready; when all of a slot's parameters are ready its
reduction is launched asynchronously through the :class:`GradReduction` strategy. Slots
launch in one fixed global order on every rank (a ready slot waits for earlier ones), so
ranks always issue the same collectives in the same order. ``flush()`` launches whatever
is left (parameters that got no gradient count as zeros) and waits for everything.

The policy is small data (:class:`ReductionPolicy`), not a subclass per stage:

* ``every_micro_step``: stages 2/3 reduce on every micro-step and accumulate into the
  gradient shard (their full gradients are freed as soon as they are packed); stages 0/1
  keep full gradients and reduce only at the accumulation boundary;
* ``check``: stage 3 runs a tiny cross-rank agreement before each launch, so a
  rank-divergent module order raises instead of hanging;
* ``on_ready`` / ``after_flush``: stage 3 releases a unit's gathered parameters once all
  its gradients are in, and every gathered unit after the reduction.

With optimizer offload the reduced gradient slices must also reach the host. On the
micro-step that ends the accumulation window, grad-ready hooks also complete the
reductions that have already finished and start their device -> host copies
(``slot.stage_host_grad()``), so the copies stream while backward computes the remaining
gradients instead of all waiting for the optimizer step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch
import torch.nn as nn

from shardspeed import comm
from shardspeed.zero.grad_reduction import GradReduction, Launched


class GradSlot(Protocol):
    """What the reducer needs of one collective's worth of gradients."""

    params: list[nn.Parameter]
    group_index: int  # the optimizer param group: picks the slot's GradReduction
    streams_to_host: bool  # optimizer offload: the reduced slice is copied to the host

    def describe(self) -> str: ...

    def owned_range(self) -> tuple[int, int] | None:
        """This rank's (lo, hi) within the bucket, or None if every rank keeps all of it."""

    def on_grad(self, param: nn.Parameter) -> None:
        """Called first in every grad hook (stages 0/1 accumulate into the flat buffer)."""

    def reduce_input(self, dtype: torch.dtype) -> torch.Tensor:
        """The whole padded bucket of gradients, ``(numel,)`` in ``dtype``."""

    def store(self, reduced: torch.Tensor) -> None:
        """Keep this rank's averaged slice (copy, or accumulate across micro-steps)."""

    def stage_host_grad(self) -> None: ...


@dataclass(frozen=True)
class ReductionPolicy:
    """When the reducer runs and what a stage adds around it (see the module docstring)."""

    every_micro_step: bool
    reduce_dtype: torch.dtype
    overlap: bool = True
    pre_factor: float = 1.0
    check: Callable[[int, str], None] | None = None
    on_ready: Callable[[GradSlot], None] | None = None
    after_flush: Callable[[], None] | None = None
    tag: str = "reduce_grads"


@dataclass
class _InFlight:
    slot: GradSlot
    launched: Launched


class GradReducer:
    """Launches and completes gradient reductions for an ordered list of slots."""

    def __init__(
        self,
        slots: Sequence[GradSlot],
        reductions: Sequence[GradReduction],
        policy: ReductionPolicy,
        *,
        is_boundary: Callable[[], bool],
    ) -> None:
        self.order = list(slots)
        self.reductions = reductions  # per optimizer param group (data or expert axis)
        self.policy = policy
        self.is_boundary = is_boundary
        self.sync_enabled = True
        self.dirty = False  # a gradient arrived since the last completed reduction
        self.streams_to_host = any(s.streams_to_host for s in self.order)
        self.slot_of: dict[nn.Parameter, int] = {}
        self._position = {id(slot): pos for pos, slot in enumerate(self.order)}
        for pos, slot in enumerate(self.order):
            for p in slot.params:
                self.slot_of[p] = pos
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in self.slot_of
        ]
        self._reset_micro_step()

    # -- per micro-step state ------------------------------------------------------------
    def _reset_micro_step(self) -> None:
        self.seen: list[set[int]] = [set() for _ in self.order]
        self.ready = [False] * len(self.order)
        self.next_launch = 0
        self.in_flight: list[_InFlight] = []

    def reducing_this_micro_step(self) -> bool:
        return self.sync_enabled and (self.policy.every_micro_step or self.is_boundary())

    def is_ready(self, slot: GradSlot) -> bool:
        """All of ``slot``'s gradients arrived this micro-step (or it was launched)."""
        return self.ready[self._position[id(slot)]]

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        pos = self.slot_of[param]
        slot = self.order[pos]
        self.dirty = True
        slot.on_grad(param)
        if not self.reducing_this_micro_step():
            return
        self.seen[pos].add(id(param))
        if len(self.seen[pos]) == len(slot.params):
            self.ready[pos] = True
            if self.policy.on_ready is not None:
                self.policy.on_ready(slot)
            if self.policy.overlap:
                self._launch_ready()
        if self.streams_to_host and self.is_boundary():
            self._complete_finished()

    def _launch_ready(self) -> None:
        while self.next_launch < len(self.order) and self.ready[self.next_launch]:
            self._launch(self.next_launch)

    @torch.no_grad()
    def _launch(self, pos: int) -> None:
        slot = self.order[pos]
        self.next_launch = pos + 1
        with comm.set_current_tag(f"{self.policy.tag} {slot.describe()}"):
            if self.policy.check is not None:
                self.policy.check(-(pos + 1), f"reduce the gradients of {slot.describe()}")
            buf = slot.reduce_input(self.policy.reduce_dtype)
            if self.policy.pre_factor != 1.0:
                buf.div_(self.policy.pre_factor)
            launched = self.reductions[slot.group_index].launch(buf, slot.owned_range())
            self.in_flight.append(_InFlight(slot, launched))

    # -- completion ----------------------------------------------------------------------
    @torch.no_grad()
    def _complete_finished(self) -> None:
        """Finish (and stream to the host) the in-flight reductions that are already done."""
        done, self.in_flight = take_completed(self.in_flight, lambda item: item.launched.work)
        for item in done:
            self._finish(item)

    @torch.no_grad()
    def flush(self) -> None:
        """Launch every remaining slot, wait, and store the averaged gradients.

        Acts once per reduction window: a no-op when no gradient arrived since the last
        completed reduction, or when this micro-step does not reduce (stages 0/1 off the
        boundary, or inside ``no_sync``).
        """
        if not self.dirty or not self.reducing_this_micro_step():
            return
        while self.next_launch < len(self.order):
            self._launch(self.next_launch)
        for item in self.in_flight:
            if item.launched.work is not None:
                item.launched.work.wait()
            self._finish(item)
        self._reset_micro_step()
        self.dirty = False
        if self.policy.after_flush is not None:
            self.policy.after_flush()

    def _finish(self, item: _InFlight) -> None:
        slot, out = item.slot, item.launched.out
        shard = slot.owned_range()
        if item.launched.full and shard is not None:  # keep only this rank's slice
            out = out[shard[0] : shard[1]]
        post_factor = self.reductions[slot.group_index].average_over / self.policy.pre_factor
        if post_factor != 1.0:
            out.div_(post_factor)
        slot.store(out)
        if slot.streams_to_host and self.is_boundary():
            slot.stage_host_grad()  # the window's final gradient: stream it now

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []


T = TypeVar("T")


def take_completed(items: list[T], work_of: Callable[[T], Any]) -> tuple[list[T], list[T]]:
    """Split in-flight reductions into (those whose collective has completed, the rest),
    keeping their order. Completed handles are waited on, which re-raises a failure."""
    done: list[T] = []
    pending: list[T] = []
    for item in items:
        work = work_of(item)
        if work is None or work.is_completed():
            if work is not None:
                work.wait()
            done.append(item)
        else:
            pending.append(item)
    return done, pending
