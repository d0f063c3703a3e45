"""Pipeline schedules (GPipe, 1F1B, interleaved 1F1B, inference) as pure functions.

A schedule is built in two moves:

1. **Compute order.** Each stage gets the order of its forward (F) and backward (B) passes:

   * ``gpipe``: every F, then every B (``m`` micro-batches in flight);
   * ``1f1b``: ``p - s - 1`` warm-up forwards, then alternate F and B, then drain
     (at most ``p`` micro-batches in flight on stage 0: PipeDream-flush);
   * ``interleaved``: 1F1B over ``p * v`` virtual stages, micro-batches taken in groups
     of ``p`` and chunk-major inside a group (Megatron-LM's order); the bubble shrinks by
     ``v`` at the cost of ``v`` times more p2p messages;
   * inference: forward only.

2. **Time slots.** Every stage runs the next pass of its order as soon as its inputs
   were produced in an earlier slot (unit cost per pass). Each transfer between stages is
   placed in the *communication phase* right after the slot that produced it, and inside
   a phase every stage issues its transfers in one global order. Because both ends of
   every transfer see the same order, the schedule cannot deadlock even when every send
   blocks until its receive is posted (the strictest semantics; proved by induction on
   that order, and checked by :mod:`~shardspeed.parallel.pipeline.simulate`).

Step ``t`` of a stage is ``[phase-t transfers..., LoadMicroBatch?, F or B of slot t]``; the
last step holds the final transfers and ``ReduceTiedGrads, ReduceGrads, OptimizerStep``.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from shardspeed.parallel.pipeline.instructions import (
    BackwardPass,
    CommInstruction,
    ForwardPass,
    LoadMicroBatch,
    OptimizerStep,
    PipeInstruction,
    RecvActivation,
    RecvGrad,
    ReduceGrads,
    ReduceTiedGrads,
    SendActivation,
    SendGrad,
)

SCHEDULES = ("gpipe", "1f1b", "interleaved")
ScheduleKind = Literal["gpipe", "1f1b", "interleaved"]
# One compute pass: ("F" | "B", micro_batch, virtual_stage)
Pass = tuple[str, int, int]


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

    def __iter__(self) -> Iterator[tuple[PipeInstruction, ...]]:
        return iter(self.steps)

    def __len__(self) -> int:
        return len(self.steps)

    def instructions(self) -> list[PipeInstruction]:
        """Every instruction in execution order (the steps concatenated)."""
        return [instr for step in self.steps for instr in step]


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
    if kind != "interleaved" and v != 1:
        raise ValueError(
            f"virtual_stages={v} needs schedule='interleaved' (got schedule={kind!r}); "
            "use virtual_stages=1 or the interleaved schedule."
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


def _check_inference_args(num_micro_batches: int, num_stages: int, virtual_stages: int) -> None:
    _check_int("num_micro_batches", num_micro_batches, 1)
    p = _check_int("num_stages", num_stages, 1)
    v = _check_int("virtual_stages", virtual_stages, 1)
    if v > 1 and p < 2:
        raise ValueError(f"virtual_stages={v} needs num_stages >= 2 (got {p}).")


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


def compute_order(
    kind: str,
    num_micro_batches: int,
    num_stages: int,
    stage_id: int,
    virtual_stages: int = 1,
    train: bool = True,
) -> list[Pass]:
    """The order of forward/backward passes on ``stage_id``: ``[("F"|"B", mb, vstage)]``."""
    m, p, v, s = num_micro_batches, num_stages, virtual_stages, stage_id
    if not train:
        # Forward only; chunk-major inside groups of p micro-batches.
        keys = sorted((mb // p, c, mb) for mb in range(m) for c in range(v))
        return [("F", mb, c * p + s) for _, c, mb in keys]
    if kind == "gpipe":
        return [("F", mb, s) for mb in range(m)] + [("B", mb, s) for mb in range(m)]
    if kind == "1f1b":
        warmup = min(p - s - 1, m)
        order: list[Pass] = [("F", mb, s) for mb in range(warmup)]
        for i in range(m - warmup):
            order += [("F", warmup + i, s), ("B", i, s)]
        return order + [("B", mb, s) for mb in range(m - warmup, m)]
    # interleaved: one 1F1B over the rank's m * v virtual micro-batches
    total = m * v
    warmup = min((p - s - 1) * 2 + (v - 1) * p, total)

    def fwd(k: int) -> Pass:
        mb, c = _interleaved_pass(k, p, v, forward=True)
        return ("F", mb, c * p + s)

    def bwd(k: int) -> Pass:
        mb, c = _interleaved_pass(k, p, v, forward=False)
        return ("B", mb, c * p + s)

    order = [fwd(k) for k in range(warmup)]
    for i in range(total - warmup):
        order += [fwd(warmup + i), bwd(i)]
    return order + [bwd(k) for k in range(total - warmup, total)]


def _dependencies(op: Pass, num_vstages: int) -> list[Pass]:
    kind, mb, k = op
    if kind == "F":
        return [("F", mb, k - 1)] if k > 0 else []
    deps = [("F", mb, k)]
    if k < num_vstages - 1:
        deps.append(("B", mb, k + 1))
    return deps


# ----------------------------------------------------------------------------- time slots
@functools.lru_cache(maxsize=256)
def _timeline(
    kind: str, m: int, p: int, v: int, train: bool
) -> tuple[tuple[Pass | None, ...], ...]:
    """``slots[stage][t]``: the pass a stage runs in slot ``t`` (None = idle), unit costs."""
    orders = [compute_order(kind, m, p, s, v, train) for s in range(p)]
    done: dict[Pass, int] = {}
    position = [0] * p
    slots: list[list[Pass | None]] = [[] for _ in range(p)]
    t = 0
    while any(position[s] < len(orders[s]) for s in range(p)):
        ran = []
        for s in range(p):
            op = orders[s][position[s]] if position[s] < len(orders[s]) else None
            if op is not None and all(done.get(d, t) < t for d in _dependencies(op, p * v)):
                ran.append(op)
                slots[s].append(op)
                position[s] += 1
            else:
                slots[s].append(None)
        if not ran:  # an order that waits on itself: a bug in compute_order
            raise AssertionError(f"pipeline compute order for {kind} m={m} p={p} v={v} stalls")
        for op in ran:
            done[op] = t
        t += 1
    return tuple(tuple(row) for row in slots)


def _transfers_by_phase(
    slots: tuple[tuple[Pass | None, ...], ...], p: int, v: int, train: bool
) -> dict[int, list[tuple[str, int, int]]]:
    """Transfers ``(carries, mb, src_vstage)`` grouped by the phase after their producer."""
    phases: dict[int, list[tuple[str, int, int]]] = {}
    last = p * v - 1
    for row in slots:
        for t, op in enumerate(row):
            if op is None:
                continue
            kind, mb, k = op
            if kind == "F" and k < last and p > 1:
                phases.setdefault(t + 1, []).append(("activation", mb, k))
            if kind == "B" and k > 0 and p > 1 and train:
                phases.setdefault(t + 1, []).append(("grad", mb, k))
    for items in phases.values():
        items.sort(key=lambda x: (x[2], x[0], x[1]))  # one global order per phase
    return phases


def _comm_for_stage(
    transfer: tuple[str, int, int], stage_id: int, p: int
) -> CommInstruction | None:
    carries, mb, src = transfer
    dst = src + 1 if carries == "activation" else src - 1
    if src % p == stage_id:
        cls = SendActivation if carries == "activation" else SendGrad
        return cls(mb, src // p, peer=dst % p)
    if dst % p == stage_id:
        cls = RecvActivation if carries == "activation" else RecvGrad
        return cls(mb, dst // p, peer=src % p)
    return None


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
    accepts any ``kind`` and ignores it apart from ``virtual_stages``.
    """
    if train:
        check_schedule_args(kind, num_micro_batches, num_stages, virtual_stages)
    else:
        _check_inference_args(num_micro_batches, num_stages, virtual_stages)
    if not 0 <= stage_id < num_stages:
        raise ValueError(f"stage_id={stage_id!r} must be in [0, num_stages={num_stages}).")
    m, p, v = num_micro_batches, num_stages, virtual_stages
    slots = _timeline(kind if train else "inference", m, p, v, train)
    phases = _transfers_by_phase(slots, p, v, train)
    last = p * v - 1
    steps: list[tuple[PipeInstruction, ...]] = []
    for t in range(len(slots[0]) + 1):
        step: list[PipeInstruction] = []
        for transfer in phases.get(t, []):
            instr = _comm_for_stage(transfer, stage_id, p)
            if instr is not None:
                step.append(instr)
        op = slots[stage_id][t] if t < len(slots[stage_id]) else None
        if op is not None:
            pass_kind, mb, k = op
            chunk = k // p
            if pass_kind == "F":
                if k == 0 or k == last:
                    step.append(LoadMicroBatch(mb, chunk))
                step.append(ForwardPass(mb, chunk))
            else:
                step.append(BackwardPass(mb, chunk))
        if t == len(slots[0]) and train:
            step += [ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]
        steps.append(tuple(step))
    return PipeSchedule(kind if train else "inference", m, p, stage_id, v, train, tuple(steps))


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
