"""Zero-bubble schedules (ZB-H1, ZBV, DualPipeV) as data: passes, transfers, deadlock
freedom, bubble and memory against 1F1B, the V placement, and the simulator's table."""

from __future__ import annotations

import itertools
from collections import defaultdict

import pytest

from shardspeed.parallel.pipeline.instructions import (
    BackwardInput,
    BackwardPass,
    BackwardWeight,
    CommInstruction,
    ForwardPass,
    LoadMicroBatch,
    OptimizerStep,
    RecvActivation,
    RecvGrad,
    SendActivation,
    SendGrad,
    locate_vstage,
    transfer_key,
    vstage_of,
)
from shardspeed.parallel.pipeline.schedule import (
    SCHEDULES,
    all_stage_schedules,
    build_schedule,
    compute_order,
    compute_orders,
    zero_bubble_schedule,
)
from shardspeed.parallel.pipeline.simulate import (
    activation_peak,
    format_table,
    in_flight_peak,
    schedule_table,
    simulate,
    simulate_schedule,
    split_cost,
    unit_cost,
)

ZB = ("zb-h1", "zbv", "dualpipev")


def chunks_of(kind: str) -> int:
    return 1 if kind == "zb-h1" else 2


def _cases() -> list[tuple[str, int, int]]:
    cases = []
    for kind, p, m in itertools.product(ZB, (1, 2, 3, 4), range(1, 9)):
        if kind == "dualpipev" and m < 2 * p - 1:
            continue
        cases.append((kind, p, m))
    return cases


CASES = _cases()
IDS = [f"{k}-p{p}-m{m}" for k, p, m in CASES]


def schedules_of(kind: str, p: int, m: int, train: bool = True):
    return all_stage_schedules(kind, m, p, chunks_of(kind), train)


def _backward_at(pos: dict[tuple, int], mb: int, c: int) -> int:
    """Position of the (input-gradient) backward; a split one has its W after it."""
    if (BackwardPass, mb, c) in pos:  # a fused backward (DualPipeV's pairs)
        assert (BackwardInput, mb, c) not in pos and (BackwardWeight, mb, c) not in pos
        return pos[(BackwardPass, mb, c)]
    assert pos[(BackwardInput, mb, c)] < pos[(BackwardWeight, mb, c)], (mb, c)
    return pos[(BackwardInput, mb, c)]


@pytest.mark.parametrize(("kind", "p", "m"), CASES, ids=IDS)
def test_one_f_b_w_per_virtual_stage_in_dependency_order(kind: str, p: int, m: int) -> None:
    v = chunks_of(kind)
    schedules = schedules_of(kind, p, m)
    placement = schedules[0].placement
    last = p * v - 1
    for stage, schedule in enumerate(schedules):
        stream = schedule.instructions()
        pos: dict[tuple, int] = {}
        for n, instr in enumerate(stream):
            if hasattr(instr, "chunk"):
                key = (type(instr), instr.micro_batch, instr.chunk)
                assert key not in pos, f"stage {stage}: {instr} twice"
                pos[key] = n
        for mb, c in itertools.product(range(m), range(v)):
            k = vstage_of(stage, c, p, placement)
            f, b = pos[(ForwardPass, mb, c)], _backward_at(pos, mb, c)
            assert f < b, (stage, mb, c)
            if k == 0:
                assert pos[(LoadMicroBatch, mb, c)] < f
            elif locate_vstage(k - 1, p, placement)[0] != stage:
                assert pos[(RecvActivation, mb, c)] < f
                assert b < pos[(SendGrad, mb, c)]
            else:  # the turn of the V: the previous chunk is local and runs first
                prev = locate_vstage(k - 1, p, placement)[1]
                assert pos[(ForwardPass, mb, prev)] < f and b < _backward_at(pos, mb, prev)
                assert (RecvActivation, mb, c) not in pos and (SendGrad, mb, c) not in pos
            if k < last and locate_vstage(k + 1, p, placement)[0] != stage:
                assert f < pos[(SendActivation, mb, c)]
                assert pos[(RecvGrad, mb, c)] < b
            if k == last:  # labels loaded on this stage before the loss
                loads = [n for (t, i, _), n in pos.items() if t is LoadMicroBatch and i == mb]
                assert len(loads) == 1 and loads[0] < f
        assert isinstance(stream[-1], OptimizerStep)


@pytest.mark.parametrize(("kind", "p", "m"), CASES, ids=IDS)
def test_sends_match_receives_between_neighbours(kind: str, p: int, m: int) -> None:
    schedules = schedules_of(kind, p, m)
    placement = schedules[0].placement
    sent: dict[tuple[int, int], list] = defaultdict(list)
    received: dict[tuple[int, int], list] = defaultdict(list)
    for stage, schedule in enumerate(schedules):
        for instr in schedule.instructions():
            if isinstance(instr, CommInstruction):
                assert instr.peer in (stage + 1, stage - 1), instr  # neighbours only
                channel = (stage, instr.peer) if instr.is_send else (instr.peer, stage)
                book = sent if instr.is_send else received
                book[channel].append(transfer_key(instr, stage, p, placement))
    assert set(sent) == set(received)
    for channel, keys in sent.items():
        assert keys == received[channel], channel
        for carries, _, src, dst in keys:
            assert dst == (src + 1 if carries == "activation" else src - 1)
            # the V's turn (p-1 -> p) never crosses a link
            assert {src, dst} != {p - 1, p} or placement != "v"


@pytest.mark.parametrize(("kind", "p", "m"), CASES, ids=IDS)
def test_no_deadlock_under_every_semantics(kind: str, p: int, m: int) -> None:
    schedules = schedules_of(kind, p, m)
    streams = [s.instructions() for s in schedules]
    for cost in (split_cost(1, 1, 1), unit_cost(1, 2), split_cost(1, 2, 0.5), split_cost(3, 1, 1)):
        for mode in ("rendezvous", "buffered", "async"):
            simulate(streams, cost, mode=mode, placement=schedules[0].placement)
    inference = schedules_of(kind, p, m, train=False)
    for mode in ("rendezvous", "async"):
        streams = [s.instructions() for s in inference]
        simulate(streams, mode=mode, placement=inference[0].placement)
    for schedule in inference:
        kinds = {type(i) for i in schedule.instructions()}
        assert kinds <= {LoadMicroBatch, ForwardPass, SendActivation, RecvActivation}


def _bubble(kind: str, p: int, m: int) -> tuple[float, ...]:
    v = 2 if kind in ("zbv", "dualpipev", "interleaved") else 1
    return simulate_schedule(kind, m, p, cost=split_cost(1 / v, 1 / v, 1 / v)).idle_fraction


def test_zero_bubble_schedules_beat_1f1b() -> None:
    """p=4, m=8, F=B=W=1: 1F1B idles (p-1)*3 of 3m+(p-1)*3 = 0.273 on every stage."""
    baseline = _bubble("1f1b", 4, 8)
    assert max(baseline) == pytest.approx(9 / 33)
    bubbles = {kind: max(_bubble(kind, 4, 8)) for kind in ZB}
    for kind, bubble in bubbles.items():
        assert bubble < min(baseline), (kind, bubble)
    assert bubbles["zbv"] < bubbles["zb-h1"]
    assert bubbles["zbv"] == pytest.approx(3 / 51)  # near the ideal: only the ramp-up


@pytest.mark.parametrize(("p", "m"), [(p, m) for p in (2, 3, 4, 5) for m in (1, 2, 4, 8, 12)])
def test_zb_h1_keeps_1f1b_memory(p: int, m: int) -> None:
    """Alive from F until W: never more than 1F1B's stage-0 peak ``min(p, m)``."""
    one_f_one_b = [in_flight_peak(s.instructions()) for s in all_stage_schedules("1f1b", m, p)]
    zb_h1 = [in_flight_peak(s.instructions()) for s in all_stage_schedules("zb-h1", m, p)]
    assert max(zb_h1) <= max(one_f_one_b) == min(p, m)
    assert zb_h1[0] == one_f_one_b[0]
    assert _bubble("zb-h1", p, m)[0] <= _bubble("1f1b", p, m)[0] + 1e-9


@pytest.mark.parametrize("p", [2, 3, 4])
def test_v_schedules_memory_in_stage_units(p: int) -> None:
    """ZBV holds at most 2p chunk micro-batches: p micro-batches of a whole stage."""
    for kind in ("zbv", "dualpipev"):
        for schedule in all_stage_schedules(kind, 4 * p, p, 2):
            stream = schedule.instructions()
            assert activation_peak(stream, 0.5) <= in_flight_peak(stream)
            if kind == "zbv":
                assert in_flight_peak(stream) <= 2 * p


def test_v_placement() -> None:
    p = 4
    for k in range(2 * p):
        stage, chunk = locate_vstage(k, p, "v")
        assert vstage_of(stage, chunk, p, "v") == k
    assert locate_vstage(0, p, "v") == (0, 0) and locate_vstage(2 * p - 1, p, "v") == (0, 1)
    assert locate_vstage(p - 1, p, "v") == (p - 1, 0) and locate_vstage(p, p, "v") == (p - 1, 1)
    # stage 0 loads each micro-batch once (inputs and labels), the others never
    for schedule in all_stage_schedules("zbv", 6, p, 2):
        loads = [i for i in schedule.instructions() if isinstance(i, LoadMicroBatch)]
        assert len(loads) == (6 if schedule.stage_id == 0 else 0)
        assert schedule.placement == "v" and schedule.splits_backward


def test_orders_are_pinned() -> None:
    """The exact orders for p=2 (a change here changes the engine's behaviour)."""

    def show(kind: str, m: int, s: int, v: int = 1) -> str:
        return " ".join(f"{k}{mb}.{vs}" for k, mb, vs in compute_order(kind, m, 2, s, v))

    assert show("zb-h1", 4, 0) == "F0.0 F1.0 B0.0 W0.0 B1.0 F2.0 W1.0 F3.0 B2.0 W2.0 B3.0 W3.0"
    assert show("zb-h1", 4, 1) == "F0.1 B0.1 F1.1 B1.1 W0.1 W1.1 F2.1 B2.1 F3.1 B3.1 W2.1 W3.1"
    assert show("zbv", 2, 0, 2) == ("F0.0 F1.0 F0.3 B0.3 F1.3 B1.3 B0.0 W0.3 B1.0 W1.3 W0.0 W1.0")
    pairs = [g for g in compute_orders("dualpipev", 4, 2, 2)[0] if len(g) == 2]
    assert pairs == [(("F", 3, 0), ("BW", 1, 3)), (("F", 2, 3), ("BW", 0, 0)),
                     (("F", 3, 3), ("BW", 1, 0))]  # fmt: skip
    # a DualPipeV pair is one step: both passes, then their transfers in the next phase
    steps = build_schedule("dualpipev", 4, 2, 0, 2).steps
    paired = [s for s in steps if sum(isinstance(i, ForwardPass | BackwardPass) for i in s) == 2]
    assert len(paired) == 3


def test_table_covers_every_schedule() -> None:
    rows = schedule_table(4, 8)
    assert [r.kind for r in rows] == list(SCHEDULES)
    by_kind = {r.kind: r for r in rows}
    assert max(by_kind["zb-h1"].peak_in_flight) <= max(by_kind["1f1b"].peak_in_flight) == 4
    assert by_kind["zbv"].peak_in_flight[0] == 4  # 2p chunks of half a stage
    text = format_table(rows)
    assert text.count("\n") == len(rows) + 1 and "| zbv |" in text
    assert [r.kind for r in schedule_table(4, 4)] == [k for k in SCHEDULES if k != "dualpipev"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("zbv", 4, 2, 0, 1), "virtual_stages=2"),
        (("dualpipev", 4, 4, 0, 2), "at least 2 \\* num_stages - 1 = 7"),
        (("zb-h1", 4, 2, 0, 2), "virtual_stages=2 needs schedule='interleaved'"),
    ],
)
def test_bad_arguments_name_the_problem(args: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_schedule(*args)
    with pytest.raises(ValueError, match="allowed"):
        zero_bubble_schedule("1f1b", 4, 2, 0)
    assert zero_bubble_schedule("zbv", 4, 2, 1).virtual_stages == 2


def test_pipeline_module_places_chunks_in_a_v() -> None:
    import torch.nn as nn

    from shardspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
    from shardspeed.topology import Topology

    layers = [TiedLayerSpec("embed", nn.Embedding, 16, 4)]
    layers += [LayerSpec(nn.Linear, 4, 4) for _ in range(6)]
    layers += [TiedLayerSpec("embed", nn.Embedding, 16, 4, forward_fn=lambda e, x: x)]
    for stage in range(4):
        module = PipelineModule(layers, topology=Topology(4, pp=4, rank=stage),
                                partition_method="uniform", schedule="dualpipev")  # fmt: skip
        assert module.virtual_stages == 2 and module.placement == "v"
        assert [module.stage_layer_indices(c) for c in (0, 1)] == [[stage], [7 - stage]]
        assert module.tie_owners() == {"embed": [0]}  # both ends of the V on stage 0
    with pytest.raises(ValueError, match="exactly two chunks"):
        PipelineModule(layers, topology=Topology(4, pp=4, rank=0), schedule="zbv",
                       virtual_stages=3)  # fmt: skip
