"""Execute schedules on a virtual clock: deadlock check, makespan and bubble per stage.

Every stage walks its instruction stream in order. Compute instructions advance the
stage's clock by their cost. Transfers follow one of three semantics (``mode``):

* ``"rendezvous"`` (default, the strictest): a send blocks until the peer's matching
  receive is at the head of the peer's stream, and vice versa;
* ``"buffered"``: sends never block; a receive blocks until its data was sent;
* ``"async"``: what the engine does: sends never block, receives are *posted* in stream
  order and only the pass that consumes the data (``ForwardPass`` for an activation,
  ``BackwardPass`` for a gradient) waits for it.

Both ends must name the same transfer (kind, micro-batch, virtual stages); a mismatch
raises :class:`ScheduleMismatch`, a state where no stage can move raises
:class:`PipelineDeadlock`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from shardspeed.parallel.pipeline.instructions import (
    BackwardPass,
    CommInstruction,
    ForwardPass,
    PipeInstruction,
    transfer_key,
)


class PipelineDeadlock(RuntimeError):
    """No stage can make progress (every head is a transfer whose peer is elsewhere)."""


class ScheduleMismatch(RuntimeError):
    """The two ends of a transfer disagree on what is being sent."""


@dataclass(frozen=True)
class SimResult:
    """Outcome of :func:`simulate`: total time and per-stage busy (compute) time."""

    makespan: float
    busy: tuple[float, ...]

    @property
    def idle_fraction(self) -> tuple[float, ...]:
        """Per stage: the share of the makespan not spent computing (the bubble)."""
        if self.makespan <= 0:
            return tuple(0.0 for _ in self.busy)
        return tuple(1.0 - b / self.makespan for b in self.busy)


def unit_cost(forward: float = 1.0, backward: float = 1.0) -> Callable[[PipeInstruction], float]:
    """Cost function: ``forward``/``backward`` per pass, everything else free."""

    def cost(instr: PipeInstruction) -> float:
        if isinstance(instr, ForwardPass):
            return forward
        if isinstance(instr, BackwardPass):
            return backward
        return 0.0

    return cost


def simulate(
    streams: Sequence[Sequence[PipeInstruction]],
    cost: Callable[[PipeInstruction], float] | None = None,
    mode: Literal["rendezvous", "buffered", "async"] = "rendezvous",
) -> SimResult:
    """Run one instruction stream per stage (index = stage id); see the module docstring."""
    if mode not in ("rendezvous", "buffered", "async"):
        raise ValueError(f"mode={mode!r}: allowed 'rendezvous', 'buffered', 'async'.")
    cost = cost or unit_cost()
    p = len(streams)
    pos = [0] * p
    clock = [0.0] * p
    busy = [0.0] * p
    channels: dict[tuple[int, int], deque[tuple[tuple, float]]] = {}
    # async mode: sends per channel (key, time); posted receives per stage
    sent: dict[tuple[int, int], list[tuple[tuple, float]]] = {}
    num_posted: dict[tuple[int, int], int] = {}
    posted: list[dict[tuple[str, int, int], tuple[tuple[int, int], int, tuple]]] = [
        {} for _ in range(p)
    ]

    def head(s: int) -> PipeInstruction | None:
        return streams[s][pos[s]] if pos[s] < len(streams[s]) else None

    def data_ready(s: int, instr: PipeInstruction) -> float | None:
        """async mode: when the data a pass consumes arrived (None: not sent yet)."""
        if mode != "async" or not isinstance(instr, ForwardPass | BackwardPass):
            return 0.0
        carries = "activation" if isinstance(instr, ForwardPass) else "grad"
        entry = posted[s].get((carries, instr.micro_batch, instr.chunk))
        if entry is None:
            return 0.0
        channel, index, key = entry
        if len(sent.get(channel, [])) <= index:
            return None
        sent_key, sent_at = sent[channel][index]
        if sent_key != key:
            raise ScheduleMismatch(f"stage {s} posted a receive for {key}, got {sent_key}")
        return sent_at

    def advance_local(s: int) -> bool:
        moved = False
        while (instr := head(s)) is not None and not isinstance(instr, CommInstruction):
            ready = data_ready(s, instr)
            if ready is None:
                break
            c = cost(instr)
            clock[s] = max(clock[s], ready) + c
            if isinstance(instr, ForwardPass | BackwardPass):
                busy[s] += c
            pos[s] += 1
            moved = True
        return moved

    def try_transfer(s: int) -> bool:
        instr = head(s)
        if not isinstance(instr, CommInstruction):
            return False
        key = transfer_key(instr, s, p)
        q = instr.peer
        if mode == "async":
            if instr.is_send:
                sent.setdefault((s, q), []).append((key, clock[s]))
            else:
                index = num_posted.get((q, s), 0)
                num_posted[(q, s)] = index + 1
                posted[s][(instr.carries, instr.micro_batch, instr.chunk)] = ((q, s), index, key)
            pos[s] += 1
            return True
        if mode == "buffered":
            if instr.is_send:
                channels.setdefault((s, q), deque()).append((key, clock[s]))
                pos[s] += 1
                return True
            queue = channels.get((q, s))
            if not queue:
                return False
            sent_key, sent_at = queue.popleft()
            if sent_key != key:
                raise ScheduleMismatch(f"stage {s} expected {key} from stage {q}, got {sent_key}")
            clock[s] = max(clock[s], sent_at)
            pos[s] += 1
            return True
        other = head(q)
        if not isinstance(other, CommInstruction) or other.peer != s:
            return False
        if other.is_send == instr.is_send:
            return False  # both sending to (or receiving from) each other: wait
        other_key = transfer_key(other, q, p)
        if other_key != key:
            raise ScheduleMismatch(
                f"stage {s} is at {instr} ({key}) while stage {q} is at {other} ({other_key})"
            )
        clock[s] = clock[q] = max(clock[s], clock[q])
        pos[s] += 1
        pos[q] += 1
        return True

    while any(pos[s] < len(streams[s]) for s in range(p)):
        moved = False
        for s in range(p):
            moved |= advance_local(s)
        for s in range(p):
            moved |= try_transfer(s)
        if not moved:
            heads = ", ".join(f"stage {s}: {head(s)}" for s in range(p))
            raise PipelineDeadlock(f"pipeline schedule deadlocks; heads: {heads}")
    return SimResult(makespan=max(clock, default=0.0), busy=tuple(busy))


def in_flight_peak(stream: Sequence[PipeInstruction]) -> int:
    """Most micro-batches (per chunk) forwarded but not yet backwarded, over the stream."""
    live = peak = 0
    for instr in stream:
        if isinstance(instr, ForwardPass):
            live += 1
            peak = max(peak, live)
        elif isinstance(instr, BackwardPass):
            live -= 1
    return peak
