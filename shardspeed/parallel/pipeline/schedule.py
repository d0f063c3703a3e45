"""Pipeline schedules as pure functions: GPipe, 1F1B, interleaved, zero-bubble, inference.

Passes: ``F`` (forward), ``BW`` (the whole backward) and, in the zero-bubble schedules,
``B`` (input gradients) and ``W`` (Linear weight gradients, any time after B; see
:mod:`~shardspeed.parallel.pipeline.weight_grad`). A schedule is built in two moves:

1. **Compute order.** Each stage gets the order of its passes:

   * ``gpipe``: every F, then every BW (``m`` micro-batches in flight);
   * ``1f1b``: ``p - s - 1`` warm-up forwards, then alternate F and BW, then drain
     (at most ``p`` micro-batches in flight on stage 0: PipeDream-flush);
   * ``interleaved``: 1F1B over ``p * v`` virtual stages (placement ``"linear"``),
     micro-batches taken in groups of ``p`` and chunk-major inside a group (Megatron-LM's
     order); the bubble shrinks by ``v`` at the cost of ``v`` times more p2p messages;
   * ``zb-h1`` (Qi et al., *Zero Bubble Pipeline Parallelism*, 2023): 1F1B's warm-up
     (at most ``p - s`` micro-batches between F and B on stage ``s``), B before F, and the
     W passes only where a stage would otherwise wait, never more than ``p`` micro-batches
     alive (F done, W not) on any stage: 1F1B's stage-0 memory;
   * ``zbv``: two chunks per stage in the ``"v"`` placement (stage ``s`` runs virtual
     stages ``s`` and ``2p - 1 - s``); priority B (chunk 0, then 1), F (chunk 1, then 0),
     then W, at most ``2p`` chunk passes alive per stage (``p`` micro-batches of a whole
     stage's activations, as 1F1B). ``zb-h1`` and ``zbv`` orders are produced by this
     list scheduling on the unit-cost clock below;
   * ``dualpipev`` (DeepSeek's DualPipeV, the V-shaped half of DualPipe): fixed phases
     per stage ``r``: ``2(p-r-1)`` chunk-0 forwards; ``r+1`` (F0, F1); ``p-r-1``
     (B1, W1, F1); ``m-2p+r+1`` *pairs* (F0 & BW1), (F1 & BW0); ``p-r-1`` BW1, (F1 & BW0);
     ``r+1`` (B1, B0); ``p-r-1`` (W, B0); the remaining W. A pair is one step holding a
     forward of one micro-batch and the backward of another: DualPipe overlaps their
     compute with each other's communication (on accelerators: two streams and the
     expert all-to-all); here the two passes run back to back and their transfers are
     issued together after both, which is what "overlapped" means on one CPU;
   * inference: forward only.

2. **Time slots.** Every stage starts the next entry of its order as soon as the passes
   it needs have ended (an integer clock: every pass costs 1, a BW of a zero-bubble
   schedule 2, a pair the sum). Each transfer between stages is placed in the
   *communication phase* at the end time of the pass that produced it, and inside a
   phase every stage issues its transfers in one global order. Because both ends of every
   transfer see the same order, the schedule cannot deadlock even when every send blocks
   until its receive is posted (the strictest semantics): by induction over (phase,
   position in the global order), the first unfinished transfer has both ends at the head
   of their streams, since each end reaches a phase after finishing earlier phases and
   its own compute, which waits on nothing. In the ``"v"`` placement the hand-over between
   the two chunks of the last stage is local, so it is not a transfer; the stream order
   puts the producer first. :mod:`~shardspeed.parallel.pipeline.simulate` checks all this.

Step ``t`` of a stage is ``[phase-t transfers..., LoadMicroBatch?, passes starting at t]``;
the last step holds the final transfers and ``ReduceTiedGrads, ReduceGrads,
OptimizerStep``.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

from shardspeed.parallel.pipeline.instructions import (
    BackwardInput,
    BackwardPass,
    BackwardWeight,
    CommInstruction,
    ForwardPass,
    LoadMicroBatch,
    OptimizerStep,
    PipeInstruction,
    Placement,
    RecvActivation,
    RecvGrad,
    ReduceGrads,
    ReduceTiedGrads,
    SendActivation,
    SendGrad,
    locate_vstage,
    vstage_of,
)

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zbv", "dualpipev")
ScheduleKind = Literal["gpipe", "1f1b", "interleaved", "zb-h1", "zbv", "dualpipev"]
ZERO_BUBBLE = frozenset({"zb-h1", "zbv", "dualpipev"})  # split backward (B and W passes)
V_SHAPED = frozenset({"zbv", "dualpipev"})  # two chunks per stage in the "v" placement
# One compute pass: ("F" | "BW" | "B" | "W", micro_batch, virtual_stage)
Pass = tuple[str, int, int]
# Passes issued together in one step (a DualPipeV pair); a single pass otherwise
Group = tuple[Pass, ...]
_Token = tuple[str, int, int]  # what a pass produces: itself, or ("G", mb, k) input grads


@dataclass(frozen=True)
class PipeSchedule:
    """The instruction stream of one stage: ``steps[t]`` is the list run at step ``t``."""

    kind: str
    num_micro_batches: int
    num_stages: int
    stage_id: int
    virtual_stages: int
    train: bool
    steps: tuple[tuple[PipeInstruction, ...], ...]
    placement: Placement = field(default="linear")

    def __iter__(self) -> Iterator[tuple[PipeInstruction, ...]]:
        return iter(self.steps)

    def __len__(self) -> int:
        return len(self.steps)

    def instructions(self) -> list[PipeInstruction]:
        """Every instruction in execution order (the steps concatenated)."""
        return [instr for step in self.steps for instr in step]

    @property
    def splits_backward(self) -> bool:
        """Whether the stream holds ``BackwardInput``/``BackwardWeight`` (a B/W split)."""
        return self.train and self.kind in ZERO_BUBBLE


def placement_of(kind: str) -> Placement:
    """Where the virtual stages of schedule ``kind`` live (``"v"`` for ZBV/DualPipeV)."""
    return "v" if kind in V_SHAPED else "linear"


# ----------------------------------------------------------------------------- checks
def _check_int(name: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name}={value!r}: expected an int >= {low}.")
    return value


def check_schedule_args(
    kind: str, num_micro_batches: int, num_stages: int, virtual_stages: int
) -> None:
    """Raise ``ValueError`` naming the argument when a schedule cannot be built."""
    if kind not in SCHEDULES:
        raise ValueError(
            f"schedule={kind!r} is not a pipeline schedule; allowed: {', '.join(SCHEDULES)}."
        )
    m = _check_int("num_micro_batches (gradient_accumulation_steps)", num_micro_batches, 1)
    p = _check_int("num_stages", num_stages, 1)
    v = _check_int("virtual_stages", virtual_stages, 1)
    if kind in V_SHAPED:
        if v != 2:
            raise ValueError(
                f"schedule={kind!r} places two virtual stages per stage (a V); got "
                f"virtual_stages={v}. Use virtual_stages=2 (PipelineModule sets it when "
                "left unset)."
            )
        if kind == "dualpipev" and m < 2 * p - 1:
            raise ValueError(
                f"schedule='dualpipev' needs at least 2 * num_stages - 1 = {2 * p - 1} "
                f"micro-batches (gradient_accumulation_steps={m}); raise it or use "
                "schedule='zbv'."
            )
        return
    if kind != "interleaved" and v != 1:
        raise ValueError(
            f"virtual_stages={v} needs schedule='interleaved' (got schedule={kind!r}); "
            "use virtual_stages=1 or the interleaved schedule (zbv/dualpipev take 2)."
        )
    if kind == "interleaved":
        if v < 2 or p < 2:
            raise ValueError(
                f"schedule='interleaved' needs virtual_stages >= 2 and num_stages >= 2 "
                f"(got virtual_stages={v}, num_stages={p}); use schedule='1f1b' otherwise."
            )
        if m % p:
            raise ValueError(
                f"schedule='interleaved' needs the number of micro-batches "
                f"(gradient_accumulation_steps={m}) to be a multiple of num_stages={p}; "
                f"use {((m + p - 1) // p) * p} micro-batches or schedule='1f1b'."
            )


def _check_inference_args(
    num_micro_batches: int, num_stages: int, virtual_stages: int, placement: Placement
) -> None:
    _check_int("num_micro_batches", num_micro_batches, 1)
    p = _check_int("num_stages", num_stages, 1)
    v = _check_int("virtual_stages", virtual_stages, 1)
    if placement == "v" and v != 2:
        raise ValueError(f"a V-shaped pipeline has virtual_stages=2 (got {v}).")
    if placement == "linear" and v > 1 and p < 2:
        raise ValueError(f"virtual_stages={v} needs num_stages >= 2 (got {p}).")


# ----------------------------------------------------------------------------- dependencies
def _needs(op: Pass, num_vstages: int) -> list[_Token]:
    kind, mb, k = op
    if kind == "F":
        return [("F", mb, k - 1)] if k > 0 else []
    if kind == "W":
        return [("G", mb, k)]  # after its own B
    needs: list[_Token] = [("F", mb, k)]
    if k < num_vstages - 1:
        needs.append(("G", mb, k + 1))  # the gradient of this chunk's output
    return needs


def _produces(op: Pass) -> list[_Token]:
    kind, mb, k = op
    return [op, ("G", mb, k)] if kind in ("B", "BW") else [op]


# ----------------------------------------------------------------------------- compute order
def _interleaved_pass(
    k: int, num_stages: int, virtual_stages: int, forward: bool
) -> tuple[int, int]:
    """(micro_batch, chunk) of a rank's ``k``-th forward (or backward) in Megatron's order."""
    p, v = num_stages, virtual_stages
    group, within = divmod(k, p * v)
    chunk = within // p
    if not forward:
        chunk = v - 1 - chunk
    return group * p + within % p, chunk


def _classic_order(kind: str, m: int, p: int, s: int, v: int, train: bool) -> list[Pass]:
    if not train:  # forward only; chunk-major inside groups of p micro-batches
        keys = sorted((mb // p, c, mb) for mb in range(m) for c in range(v))
        return [("F", mb, c * p + s) for _, c, mb in keys]
    if kind == "gpipe":
        return [("F", mb, s) for mb in range(m)] + [("BW", mb, s) for mb in range(m)]
    if kind == "1f1b":
        warmup = min(p - s - 1, m)
        order: list[Pass] = [("F", mb, s) for mb in range(warmup)]
        for i in range(m - warmup):
            order += [("F", warmup + i, s), ("BW", i, s)]
        return order + [("BW", mb, s) for mb in range(m - warmup, m)]
    # interleaved: one 1F1B over the rank's m * v virtual micro-batches
    total = m * v
    warmup = min((p - s - 1) * 2 + (v - 1) * p, total)

    def one(pass_kind: str, k: int) -> Pass:
        mb, c = _interleaved_pass(k, p, v, forward=pass_kind == "F")
        return (pass_kind, mb, c * p + s)

    order = [one("F", k) for k in range(warmup)]
    for i in range(total - warmup):
        order += [one("F", warmup + i), one("BW", i)]
    return order + [one("BW", k) for k in range(total - warmup, total)]


def _v_inference_order(m: int, p: int, s: int) -> list[Pass]:
    keys = sorted((mb // p, c, mb) for mb in range(m) for c in range(2))
    return [("F", mb, vstage_of(s, c, p, "v")) for _, c, mb in keys]


def _list_schedule(
    m: int, p: int, v: int, placement: Placement, priority: tuple[str, ...],
    max_alive: list[int], max_unbacked: list[int],
) -> list[list[Group]]:  # fmt: skip
    """Greedy list scheduling on the unit clock (every pass 1): in each slot a stage runs
    the first ready pass in ``priority`` (``"B<c>"``, ``"F<c>"`` for local chunk ``c``,
    ``"W"``: the oldest pending W). A forward needs fewer than ``max_alive[s]`` chunk
    passes alive (F done, W not) and fewer than ``max_unbacked[s]`` without their B."""
    nv = p * v
    vstages = [[vstage_of(s, c, p, placement) for c in range(v)] for s in range(p)]
    ended: dict[_Token, int] = {}
    next_f = [[0] * v for _ in range(p)]
    next_b = [[0] * v for _ in range(p)]
    waiting_w: list[deque[Pass]] = [deque() for _ in range(p)]
    alive, unbacked = [0] * p, [0] * p
    orders: list[list[Group]] = [[] for _ in range(p)]
    remaining, t = 3 * m * nv, 0
    while remaining:
        started: list[Pass] = []
        for s in range(p):
            ready: dict[str, Pass] = {}
            for c, k in enumerate(vstages[s]):
                b, f = ("B", next_b[s][c], k), ("F", next_f[s][c], k)
                if b[1] < m and all(ended.get(n, t + 1) <= t for n in _needs(b, nv)):
                    ready[f"B{c}"] = b
                fits = alive[s] < max_alive[s] and unbacked[s] < max_unbacked[s]
                if fits and f[1] < m and all(ended.get(n, t + 1) <= t for n in _needs(f, nv)):
                    ready[f"F{c}"] = f
            if waiting_w[s]:
                ready["W"] = waiting_w[s][0]
            op = next((ready[name] for name in priority if name in ready), None)
            if op is None:
                continue
            kind, mb, k = op
            c = vstages[s].index(k)
            if kind == "F":
                next_f[s][c] += 1
                alive[s] += 1
                unbacked[s] += 1
            elif kind == "B":
                next_b[s][c] += 1
                unbacked[s] -= 1
                waiting_w[s].append(("W", mb, k))
            else:
                waiting_w[s].popleft()
                alive[s] -= 1
            orders[s].append((op,))
            started.append(op)
        if not started:
            raise AssertionError(f"list scheduling stalls: m={m} p={p} v={v} {priority}")
        for op in started:
            for token in _produces(op):
                ended[token] = t + 1
        remaining -= len(started)
        t += 1
    return orders


def _dualpipev_order(m: int, p: int, r: int) -> list[Group]:
    """DualPipeV's phases for stage ``r`` (see the module docstring)."""
    vstage = (r, 2 * p - 1 - r)
    count_f, count_b = [0, 0], [0, 0]
    waiting_w: deque[Pass] = deque()

    def f(c: int) -> Pass:
        count_f[c] += 1
        return ("F", count_f[c] - 1, vstage[c])

    def b(c: int, split: bool) -> Pass:
        count_b[c] += 1
        op = ("B" if split else "BW", count_b[c] - 1, vstage[c])
        if split:
            waiting_w.append(("W", op[1], op[2]))
        return op

    def w() -> Pass:
        return waiting_w.popleft()

    order: list[Group] = [(f(0),) for _ in range(2 * (p - r - 1))]
    for _ in range(r + 1):
        order += [(f(0),), (f(1),)]
    for _ in range(p - r - 1):
        order += [(b(1, True),), (w(),), (f(1),)]
    for _ in range(m - 2 * p + r + 1):
        order += [(f(0), b(1, False)), (f(1), b(0, False))]
    for _ in range(p - r - 1):
        order += [(b(1, False),), (f(1), b(0, False))]
    for _ in range(r + 1):
        order += [(b(1, True),), (b(0, True),)]
    for _ in range(p - r - 1):
        order += [(w(),), (b(0, True),)]
    return order + [(w(),) for _ in range(len(waiting_w))]


@functools.lru_cache(maxsize=128)
def compute_orders(
    kind: str, num_micro_batches: int, num_stages: int, virtual_stages: int = 1,
    train: bool = True,
) -> tuple[tuple[Group, ...], ...]:  # fmt: skip
    """Per stage: the order of its pass groups (a group is one pass, or a DualPipeV pair)."""
    m, p, v = num_micro_batches, num_stages, virtual_stages
    if kind == "zb-h1" and train:
        orders = _list_schedule(m, p, 1, "linear", ("B0", "F0", "W"), [p] * p,
                                [p - s for s in range(p)])  # fmt: skip
    elif kind == "zbv" and train:
        orders = _list_schedule(m, p, 2, "v", ("B0", "B1", "F1", "F0", "W"), [2 * p] * p,
                                [2 * p] * p)  # fmt: skip
    elif kind == "dualpipev" and train:
        orders = [_dualpipev_order(m, p, r) for r in range(p)]
    elif kind in V_SHAPED:
        orders = [[(op,) for op in _v_inference_order(m, p, s)] for s in range(p)]
    else:
        orders = [[(op,) for op in _classic_order(kind, m, p, s, v, train)] for s in range(p)]
    return tuple(tuple(order) for order in orders)


def compute_order(
    kind: str, num_micro_batches: int, num_stages: int, stage_id: int, virtual_stages: int = 1,
    train: bool = True,
) -> list[Pass]:  # fmt: skip
    """The passes of ``stage_id`` in order: ``[("F"|"BW"|"B"|"W", mb, vstage)]``."""
    orders = compute_orders(kind, num_micro_batches, num_stages, virtual_stages, train)
    return [op for group in orders[stage_id] for op in group]


# ----------------------------------------------------------------------------- time slots
def _duration(kind: str, group: Group) -> int:
    """Clock units of a group: 1 per pass; a zero-bubble schedule's fused BW costs 2."""
    if kind in ZERO_BUBBLE:
        return sum(2 if op[0] == "BW" else 1 for op in group)
    return len(group)


@functools.lru_cache(maxsize=256)
def _timeline(kind: str, m: int, p: int, v: int, train: bool) -> tuple[tuple[tuple[int, Group], ...], ...]:  # fmt: skip
    """Per stage: ``(start, group)`` in order, each group as early as its inputs allow."""
    orders = compute_orders(kind, m, p, v, train)
    nv = p * v
    ended: dict[_Token, int] = {}
    free, position = [0] * p, [0] * p
    rows: list[list[tuple[int, Group]]] = [[] for _ in range(p)]
    t = 0
    while any(position[s] < len(orders[s]) for s in range(p)):
        started = False
        for s in range(p):
            if position[s] == len(orders[s]) or free[s] > t:
                continue
            group = orders[s][position[s]]
            inside = {token for op in group for token in _produces(op)}
            needs = [n for op in group for n in _needs(op, nv) if n not in inside]
            if all(ended.get(n, t + 1) <= t for n in needs):
                free[s] = t + _duration(kind, group)
                for token in inside:
                    ended[token] = free[s]
                rows[s].append((t, group))
                position[s] += 1
                started = True
        if not started and t >= max(free):  # an order that waits on itself: a bug
            raise AssertionError(f"pipeline compute order for {kind} m={m} p={p} v={v} stalls")
        t += 1
    return tuple(tuple(row) for row in rows)


def _transfers_by_phase(
    kind: str, rows: tuple[tuple[tuple[int, Group], ...], ...], p: int, v: int,
    placement: Placement,
) -> dict[int, list[tuple[str, int, int]]]:  # fmt: skip
    """Transfers ``(carries, mb, src_vstage)`` grouped by the phase their producer ends in."""
    phases: dict[int, list[tuple[str, int, int]]] = {}
    last = p * v - 1

    def crosses(src: int, dst: int) -> bool:
        return locate_vstage(src, p, placement)[0] != locate_vstage(dst, p, placement)[0]

    for row in rows:
        for start, group in row:
            end = start + _duration(kind, group)
            for pass_kind, mb, k in group:
                if pass_kind == "F" and k < last and crosses(k, k + 1):
                    phases.setdefault(end, []).append(("activation", mb, k))
                if pass_kind in ("B", "BW") and k > 0 and crosses(k, k - 1):
                    phases.setdefault(end, []).append(("grad", mb, k))
    for items in phases.values():
        items.sort(key=lambda x: (x[2], x[0], x[1]))  # one global order per phase
    return phases


def _comm_for_stage(
    transfer: tuple[str, int, int], stage_id: int, p: int, placement: Placement
) -> CommInstruction | None:
    carries, mb, src = transfer
    dst = src + 1 if carries == "activation" else src - 1
    (src_stage, src_chunk), (dst_stage, dst_chunk) = (
        locate_vstage(src, p, placement),
        locate_vstage(dst, p, placement),
    )
    if src_stage == stage_id:
        cls = SendActivation if carries == "activation" else SendGrad
        return cls(mb, src_chunk, peer=dst_stage)
    if dst_stage == stage_id:
        cls = RecvActivation if carries == "activation" else RecvGrad
        return cls(mb, dst_chunk, peer=src_stage)
    return None


def _pass_instructions(op: Pass, p: int, v: int, placement: Placement) -> list[PipeInstruction]:
    kind, mb, k = op
    stage, chunk = locate_vstage(k, p, placement)
    if kind == "F":
        last = p * v - 1
        # The first virtual stage loads the inputs, the last the labels; a stage holding
        # both (p == 1, or the V placement) loads once, before the first.
        loads = k == 0 or (k == last and locate_vstage(0, p, placement)[0] != stage)
        forward: list[PipeInstruction] = [ForwardPass(mb, chunk)]
        return [LoadMicroBatch(mb, chunk), *forward] if loads else forward
    cls = {"BW": BackwardPass, "B": BackwardInput, "W": BackwardWeight}[kind]
    return [cls(mb, chunk)]


@functools.lru_cache(maxsize=256)
def build_schedule(
    kind: str,
    num_micro_batches: int,
    num_stages: int,
    stage_id: int,
    virtual_stages: int = 1,
    train: bool = True,
) -> PipeSchedule:
    """The instruction stream of ``stage_id`` for a ``kind`` schedule (see module docstring).

    ``train=False`` gives the inference schedule (forward only, no optimizer step); it
    accepts any ``kind`` and uses it only for the placement of ``virtual_stages``.
    """
    placement = placement_of(kind)
    if train:
        check_schedule_args(kind, num_micro_batches, num_stages, virtual_stages)
    else:
        _check_inference_args(num_micro_batches, num_stages, virtual_stages, placement)
    if not 0 <= stage_id < num_stages:
        raise ValueError(f"stage_id={stage_id!r} must be in [0, num_stages={num_stages}).")
    m, p, v = num_micro_batches, num_stages, virtual_stages
    timeline_kind = kind if train or kind in V_SHAPED else "inference"
    rows = _timeline(timeline_kind, m, p, v, train)
    phases = _transfers_by_phase(timeline_kind, rows, p, v, placement)
    end = max(start + _duration(timeline_kind, g) for row in rows for start, g in row)
    starts = dict(rows[stage_id])
    steps: list[tuple[PipeInstruction, ...]] = []
    for t in range(end + 1):
        step: list[PipeInstruction] = []
        for transfer in phases.get(t, []):
            instr = _comm_for_stage(transfer, stage_id, p, placement)
            if instr is not None:
                step.append(instr)
        for op in starts.get(t, ()):
            step += _pass_instructions(op, p, v, placement)
        if t == end and train:
            step += [ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]
        steps.append(tuple(step))
    return PipeSchedule(
        kind if train else "inference", m, p, stage_id, v, train, tuple(steps), placement
    )


def gpipe_schedule(num_micro_batches: int, num_stages: int, stage_id: int) -> PipeSchedule:
    """GPipe: all forwards, then all backwards, then the optimizer step."""
    return build_schedule("gpipe", num_micro_batches, num_stages, stage_id)


def one_f_one_b_schedule(num_micro_batches: int, num_stages: int, stage_id: int) -> PipeSchedule:
    """1F1B (PipeDream-flush): bounded in-flight micro-batches, same bubble as GPipe."""
    return build_schedule("1f1b", num_micro_batches, num_stages, stage_id)


def interleaved_schedule(
    num_micro_batches: int, num_stages: int, stage_id: int, virtual_stages: int = 2
) -> PipeSchedule:
    """Interleaved 1F1B over ``virtual_stages`` model chunks per stage."""
    return build_schedule("interleaved", num_micro_batches, num_stages, stage_id, virtual_stages)


def zero_bubble_schedule(
    kind: str, num_micro_batches: int, num_stages: int, stage_id: int
) -> PipeSchedule:
    """``"zb-h1"``, ``"zbv"`` or ``"dualpipev"`` (the V schedules take two chunks)."""
    if kind not in ZERO_BUBBLE:
        raise ValueError(f"kind={kind!r}: allowed {', '.join(sorted(ZERO_BUBBLE))}.")
    v = 2 if kind in V_SHAPED else 1
    return build_schedule(kind, num_micro_batches, num_stages, stage_id, v)


def inference_schedule(
    num_micro_batches: int, num_stages: int, stage_id: int, virtual_stages: int = 1
) -> PipeSchedule:
    """Forward-only schedule for ``eval_batch``."""
    return build_schedule(
        "gpipe", num_micro_batches, num_stages, stage_id, virtual_stages, train=False
    )


def all_stage_schedules(
    kind: str,
    num_micro_batches: int,
    num_stages: int,
    virtual_stages: int = 1,
    train: bool = True,
) -> list[PipeSchedule]:
    """``build_schedule`` for every stage (for tests, the simulator and docs)."""
    return [
        build_schedule(kind, num_micro_batches, num_stages, s, virtual_stages, train)
        for s in range(num_stages)
    ]
