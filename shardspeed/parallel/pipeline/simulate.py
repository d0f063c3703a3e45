"""Execute schedules on a virtual clock: deadlock check, makespan, bubble and memory per stage.

Every stage walks its instruction stream in order. Compute instructions (F, the fused
backward BW, and the split B and W) advance the stage's clock by their cost
(:func:`unit_cost`, :func:`split_cost`). Transfers follow one of three semantics
(``mode``):

* ``"rendezvous"`` (default, the strictest): a send blocks until the peer's matching
  receive is at the head of the peer's stream, and vice versa;
* ``"buffered"``: sends never block; a receive blocks until its data was sent;
* ``"async"``: what the engine does: sends never block, receives are *posted* in stream
  order and only the pass that consumes the data (``ForwardPass`` for an activation,
  ``BackwardPass``/``BackwardInput`` for a gradient) waits for it.

``placement`` says where virtual stages live (``"v"`` for ZBV/DualPipeV, see
:mod:`~shardspeed.parallel.pipeline.instructions`); :func:`simulate_schedule` takes it
from the schedule.

Activation memory (:func:`activation_peak`), in micro-batches of one chunk's
activations: F allocates 1; a fused backward frees it; B frees all but ``weight_stash``
(what W needs: the Linear layers' inputs and output gradients) and W frees the rest.
``weight_stash=1`` is the conservative count "alive from F until W" (``SimResult.
peak_in_flight``); the paper's ``M_W / M_B`` is about 1/2 for a transformer layer.
:func:`schedule_table` compares every schedule for given ``p`` and ``m``.

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
    COMPUTE_INSTRUCTIONS,
    BackwardInput,
    BackwardPass,
    BackwardWeight,
    CommInstruction,
    ForwardPass,
    PipeInstruction,
    Placement,
    transfer_key,
)


class PipelineDeadlock(RuntimeError):
    """No stage can make progress (every head is a transfer whose peer is elsewhere)."""


class ScheduleMismatch(RuntimeError):
    """The two ends of a transfer disagree on what is being sent."""


@dataclass(frozen=True)
class SimResult:
    """Outcome of :func:`simulate`: total time, per-stage busy (compute) time and peak
    number of chunk micro-batches alive (F done, W or fused backward not yet)."""

    makespan: float
    busy: tuple[float, ...]
    peak_in_flight: tuple[int, ...] = ()

    @property
    def idle_fraction(self) -> tuple[float, ...]:
        """Per stage: the share of the makespan not spent computing (the bubble)."""
        if self.makespan <= 0:
            return tuple(0.0 for _ in self.busy)
        return tuple(1.0 - b / self.makespan for b in self.busy)


def unit_cost(forward: float = 1.0, backward: float = 1.0) -> Callable[[PipeInstruction], float]:
    """Cost function: ``forward`` per F, ``backward`` per whole backward (a split B and W
    cost half of it each), everything else free."""
    return split_cost(forward, backward / 2, backward / 2)


def split_cost(
    forward: float = 1.0, backward_input: float = 1.0, backward_weight: float = 1.0
) -> Callable[[PipeInstruction], float]:
    """Cost function for F, B and W; a fused ``BackwardPass`` costs B + W."""
    costs = {
        ForwardPass: forward,
        BackwardInput: backward_input,
        BackwardWeight: backward_weight,
        BackwardPass: backward_input + backward_weight,
    }

    def cost(instr: PipeInstruction) -> float:
        return costs.get(type(instr), 0.0)

    return cost


def simulate(
    streams: Sequence[Sequence[PipeInstruction]],
    cost: Callable[[PipeInstruction], float] | None = None,
    mode: Literal["rendezvous", "buffered", "async"] = "rendezvous",
    placement: Placement = "linear",
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
        if mode != "async" or not isinstance(instr, ForwardPass | BackwardPass | BackwardInput):
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
            if isinstance(instr, COMPUTE_INSTRUCTIONS):
                busy[s] += c
            pos[s] += 1
            moved = True
        return moved

    def try_transfer(s: int) -> bool:
        instr = head(s)
        if not isinstance(instr, CommInstruction):
            return False
        key = transfer_key(instr, s, p, placement)
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
        other_key = transfer_key(other, q, p, placement)
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
    return SimResult(
        makespan=max(clock, default=0.0),
        busy=tuple(busy),
        peak_in_flight=tuple(in_flight_peak(stream) for stream in streams),
    )


def in_flight_peak(stream: Sequence[PipeInstruction]) -> int:
    """Most chunk micro-batches alive at once: forwarded, and not yet through their fused
    backward or their W."""
    return int(activation_peak(stream, weight_stash=1.0))


def activation_peak(stream: Sequence[PipeInstruction], weight_stash: float = 1.0) -> float:
    """Peak activation memory of one stream, in micro-batches of one chunk's activations
    (module docstring): F +1, fused backward -1, B -(1 - weight_stash), W -weight_stash."""
    live = peak = 0.0
    for instr in stream:
        if isinstance(instr, ForwardPass):
            live += 1.0
            peak = max(peak, live)
        elif isinstance(instr, BackwardPass):
            live -= 1.0
        elif isinstance(instr, BackwardInput):
            live -= 1.0 - weight_stash
        elif isinstance(instr, BackwardWeight):
            live -= weight_stash
    return peak


def simulate_schedule(
    kind: str,
    num_micro_batches: int,
    num_stages: int,
    virtual_stages: int | None = None,
    cost: Callable[[PipeInstruction], float] | None = None,
    mode: Literal["rendezvous", "buffered", "async"] = "async",
) -> SimResult:
    """Build every stage's ``kind`` schedule and :func:`simulate` it (placement included).

    ``virtual_stages`` defaults to 2 for the V schedules and interleaved, else 1.
    """
    from shardspeed.parallel.pipeline.schedule import V_SHAPED, all_stage_schedules

    if virtual_stages is None:
        virtual_stages = 2 if kind in V_SHAPED or kind == "interleaved" else 1
    schedules = all_stage_schedules(kind, num_micro_batches, num_stages, virtual_stages)
    streams = [s.instructions() for s in schedules]
    return simulate(streams, cost, mode=mode, placement=schedules[0].placement)


@dataclass(frozen=True)
class ScheduleStats:
    """One row of :func:`schedule_table`; memory in micro-batches of a whole stage."""

    kind: str
    virtual_stages: int
    makespan: float
    bubble: tuple[float, ...]  # idle fraction per stage
    peak_in_flight: tuple[float, ...]  # alive from F until W (or the fused backward)
    peak_memory: tuple[float, ...]  # B frees all but ``weight_stash`` of a micro-batch


def schedule_table(
    num_stages: int,
    num_micro_batches: int,
    *,
    forward: float = 1.0,
    backward_input: float = 1.0,
    backward_weight: float = 1.0,
    weight_stash: float = 0.5,
) -> list[ScheduleStats]:
    """Every schedule that accepts ``(p, m)``, simulated in async mode with per-stage
    costs F, B, W (a fused backward costs B + W; a chunk of ``v`` costs ``1/v`` of them).

    Memory counts micro-batches of a whole stage's activations (a chunk's count ``/ v``).
    """
    from shardspeed.parallel.pipeline.schedule import (
        SCHEDULES,
        V_SHAPED,
        all_stage_schedules,
        check_schedule_args,
    )

    rows = []
    for kind in SCHEDULES:
        v = 2 if kind in V_SHAPED or kind == "interleaved" else 1
        try:
            check_schedule_args(kind, num_micro_batches, num_stages, v)
        except ValueError:
            continue
        schedules = all_stage_schedules(kind, num_micro_batches, num_stages, v)
        streams = [s.instructions() for s in schedules]
        cost = split_cost(forward / v, backward_input / v, backward_weight / v)
        result = simulate(streams, cost, mode="async", placement=schedules[0].placement)
        rows.append(
            ScheduleStats(
                kind,
                v,
                result.makespan,
                result.idle_fraction,
                tuple(count / v for count in result.peak_in_flight),
                tuple(activation_peak(st, weight_stash) / v for st in streams),
            )
        )
    return rows


def format_table(rows: Sequence[ScheduleStats], weight_stash: float = 0.5) -> str:
    """``schedule_table`` rows as a markdown table (per-stage values, stage 0 first)."""

    def per_stage(values: tuple[float, ...], fmt: str) -> str:
        return " ".join(format(x, fmt) for x in values)

    lines = [
        "| schedule | makespan | bubble (mean) | bubble per stage | peak alive F..W per stage "
        f"| peak memory per stage, B frees {1 - weight_stash:.0%} |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        name = row.kind + (f" (v={row.virtual_stages})" if row.kind == "interleaved" else "")
        lines.append(
            f"| {name} | {row.makespan:g} | {sum(row.bubble) / len(row.bubble):.3f} | "
            f"{per_stage(row.bubble, '.3f')} | {per_stage(row.peak_in_flight, 'g')} | "
            f"{per_stage(row.peak_memory, 'g')} |"
        )
    return "\n".join(lines)
