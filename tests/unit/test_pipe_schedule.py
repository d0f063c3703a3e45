"""Pipeline schedules as data: instruction-stream invariants, deadlock freedom, bubbles."""

from __future__ import annotations

import itertools
from collections import defaultdict

import pytest

from shardspeed.parallel.pipeline.instructions import (
    BackwardPass,
    CommInstruction,
    ForwardPass,
    LoadMicroBatch,
    OptimizerStep,
    RecvActivation,
    RecvGrad,
    ReduceGrads,
    ReduceTiedGrads,
    SendActivation,
    SendGrad,
    transfer_key,
)
from shardspeed.parallel.pipeline.schedule import (
    all_stage_schedules,
    build_schedule,
    gpipe_schedule,
    inference_schedule,
    interleaved_schedule,
    one_f_one_b_schedule,
)
from shardspeed.parallel.pipeline.simulate import (
    PipelineDeadlock,
    ScheduleMismatch,
    in_flight_peak,
    simulate,
    unit_cost,
)


def _cases() -> list[tuple[str, int, int, int]]:
    cases = []
    for kind, p, m in itertools.product(("gpipe", "1f1b"), (1, 2, 3, 4, 5), (1, 2, 3, 4, 7, 8)):
        cases.append((kind, p, m, 1))
    for p, v, groups in itertools.product((2, 3, 4), (2, 3), (1, 2, 3)):
        cases.append(("interleaved", p, p * groups, v))
    return cases


CASES = _cases()
IDS = [f"{k}-p{p}-m{m}-v{v}" for k, p, m, v in CASES]


def streams_of(kind: str, p: int, m: int, v: int, train: bool = True):
    return [s.instructions() for s in all_stage_schedules(kind, m, p, v, train)]


@pytest.mark.parametrize(("kind", "p", "m", "v"), CASES, ids=IDS)
def test_every_pass_once_and_forward_before_backward(kind: str, p: int, m: int, v: int) -> None:
    for stage, stream in enumerate(streams_of(kind, p, m, v)):
        fwd = [(i.micro_batch, i.chunk) for i in stream if isinstance(i, ForwardPass)]
        bwd = [(i.micro_batch, i.chunk) for i in stream if isinstance(i, BackwardPass)]
        expected = {(mb, c) for mb in range(m) for c in range(v)}
        assert sorted(fwd) == sorted(expected) and sorted(bwd) == sorted(expected), stage
        pos = {
            (type(i), i.micro_batch, i.chunk): n
            for n, i in enumerate(stream)
            if hasattr(i, "chunk")
        }
        for mb, c in expected:
            assert pos[(ForwardPass, mb, c)] < pos[(BackwardPass, mb, c)]
            vstage = c * p + stage
            if vstage > 0:  # input received before the forward that uses it
                assert pos[(RecvActivation, mb, c)] < pos[(ForwardPass, mb, c)]
                assert pos[(BackwardPass, mb, c)] < pos[(SendGrad, mb, c)]
            else:
                assert pos[(LoadMicroBatch, mb, c)] < pos[(ForwardPass, mb, c)]
            if vstage < p * v - 1:
                assert pos[(ForwardPass, mb, c)] < pos[(SendActivation, mb, c)]
                assert pos[(RecvGrad, mb, c)] < pos[(BackwardPass, mb, c)]
            else:  # last virtual stage loads the labels
                assert pos[(LoadMicroBatch, mb, c)] < pos[(ForwardPass, mb, c)]


@pytest.mark.parametrize(("kind", "p", "m", "v"), CASES, ids=IDS)
def test_sends_match_receives_in_order(kind: str, p: int, m: int, v: int) -> None:
    streams = streams_of(kind, p, m, v)
    sent: dict[tuple[int, int], list] = defaultdict(list)
    received: dict[tuple[int, int], list] = defaultdict(list)
    for stage, stream in enumerate(streams):
        for instr in stream:
            if isinstance(instr, CommInstruction):
                peer = instr.peer
                assert peer in ((stage + 1) % p, (stage - 1) % p), instr  # neighbours only
                channel = (stage, peer) if instr.is_send else (peer, stage)
                book = sent if instr.is_send else received
                book[channel].append(transfer_key(instr, stage, p))
    assert set(sent) == set(received)
    for channel in sent:
        assert sent[channel] == received[channel], channel
    # activations go to the next virtual stage, gradients to the previous one
    for keys in sent.values():
        for carries, _, src, dst in keys:
            assert dst == (src + 1 if carries == "activation" else src - 1)


@pytest.mark.parametrize(("kind", "p", "m", "v"), CASES, ids=IDS)
def test_no_deadlock_with_blocking_send_recv(kind: str, p: int, m: int, v: int) -> None:
    streams = streams_of(kind, p, m, v)
    for cost in (unit_cost(1, 1), unit_cost(1, 2), unit_cost(3, 1)):
        for mode in ("rendezvous", "buffered", "async"):
            simulate(streams, cost, mode=mode)  # raises on deadlock or mismatch


@pytest.mark.parametrize(("kind", "p", "m", "v"), CASES, ids=IDS)
def test_bubble_matches_theory(kind: str, p: int, m: int, v: int) -> None:
    """Uniform stage cost: idle fraction (p-1)/(m*v+p-1) on every stage, also with B=2F."""
    streams = streams_of(kind, p, m, v)
    expected = (p - 1) / (m * v + p - 1)
    for cost in (unit_cost(1, 1), unit_cost(1, 2)):
        result = simulate(streams, cost, mode="async")
        for idle in result.idle_fraction:
            assert idle == pytest.approx(expected, abs=1e-9)
    # unit costs: the lock-step time slots are optimal even with rendezvous sends
    result = simulate(streams, unit_cost(1, 1), mode="rendezvous")
    assert result.makespan == pytest.approx(2 * (m * v + p - 1))


@pytest.mark.parametrize(("p", "m"), [(p, m) for p in (2, 3, 4, 5) for m in (1, 3, 4, 8, 16)])
def test_in_flight_micro_batches(p: int, m: int) -> None:
    one_f_one_b = streams_of("1f1b", p, m, 1)
    gpipe = streams_of("gpipe", p, m, 1)
    assert in_flight_peak(one_f_one_b[0]) == min(p, m)
    assert in_flight_peak(gpipe[0]) == m
    for stage, stream in enumerate(one_f_one_b):
        assert in_flight_peak(stream) <= min(p - stage, m)


def test_interleaved_in_flight_bound() -> None:
    p, v, m = 4, 2, 8
    for stage, stream in enumerate(streams_of("interleaved", p, m, v)):
        # Megatron's warm-up: 2(p - s - 1) + (v - 1)p forwards, plus the first steady one
        assert in_flight_peak(stream) <= 2 * (p - stage - 1) + (v - 1) * p + 1


def test_batch_ends_with_reductions_then_step() -> None:
    for schedule in all_stage_schedules("1f1b", 4, 3):
        last = schedule.steps[-1]
        assert [type(i) for i in last[-3:]] == [ReduceTiedGrads, ReduceGrads, OptimizerStep]
        tail = [i for i in schedule.instructions() if isinstance(i, OptimizerStep | ReduceGrads)]
        assert len(tail) == 2
        for step in schedule.steps:  # at most one compute instruction per step
            assert sum(isinstance(i, ForwardPass | BackwardPass) for i in step) <= 1


def test_one_f_one_b_two_stage_stream() -> None:
    """The exact stream for p=2, m=3 (stage 1: alternate F and B, stage 0: 1 warm-up)."""
    stage0 = [
        type(i).__name__[0:4] + str(i.micro_batch)
        for i in one_f_one_b_schedule(3, 2, 0).instructions()
        if isinstance(i, ForwardPass | BackwardPass)
    ]
    stage1 = [
        type(i).__name__[0:4] + str(i.micro_batch)
        for i in one_f_one_b_schedule(3, 2, 1).instructions()
        if isinstance(i, ForwardPass | BackwardPass)
    ]
    assert stage0 == ["Forw0", "Forw1", "Back0", "Forw2", "Back1", "Back2"]
    assert stage1 == ["Forw0", "Back0", "Forw1", "Back1", "Forw2", "Back2"]
    assert len(gpipe_schedule(3, 2, 0)) == 2 * (3 + 2 - 1) + 1


def test_inference_schedule_is_forward_only() -> None:
    for v in (1, 2):
        schedules = [inference_schedule(5, 2, s, virtual_stages=v) for s in range(2)]
        for sched in schedules:
            kinds = {type(i) for i in sched.instructions()}
            assert kinds <= {LoadMicroBatch, ForwardPass, SendActivation, RecvActivation}
            assert sum(isinstance(i, ForwardPass) for i in sched.instructions()) == 5 * v
        simulate([s.instructions() for s in schedules])
    assert interleaved_schedule(4, 2, 0, 2).virtual_stages == 2


def test_simulator_detects_deadlock_and_mismatch() -> None:
    # Both stages send first: deadlocks under rendezvous, fine when buffered.
    streams = [
        [SendActivation(0, 0, peer=1), RecvGrad(0, 0, peer=1)],
        [SendGrad(0, 0, peer=0), RecvActivation(0, 0, peer=0)],
    ]
    with pytest.raises(PipelineDeadlock, match="deadlock"):
        simulate(streams)
    simulate(streams, mode="buffered")
    wrong = [[SendActivation(0, 0, peer=1)], [RecvActivation(1, 0, peer=0)]]
    with pytest.raises(ScheduleMismatch):
        simulate(wrong)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kind": "zigzag"}, "schedule='zigzag'"),
        ({"num_micro_batches": 0}, "num_micro_batches"),
        ({"kind": "1f1b", "virtual_stages": 2}, "virtual_stages=2 needs schedule='interleaved'"),
        ({"kind": "interleaved", "num_micro_batches": 3}, "multiple of num_stages=2"),
        ({"kind": "interleaved", "virtual_stages": 1}, "virtual_stages >= 2"),
        ({"stage_id": 2}, "stage_id=2"),
    ],
)
def test_bad_arguments_name_the_problem(kwargs: dict, message: str) -> None:
    args = {"kind": "interleaved", "num_micro_batches": 4, "num_stages": 2, "stage_id": 0,
            "virtual_stages": 2}  # fmt: skip
    args.update(kwargs)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build_schedule(**args)
