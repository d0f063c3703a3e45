"""LR schedules: values at chosen iterations against the formulas, state, errors."""

from __future__ import annotations

import math

import pytest
import torch

from shardspeed.runtime.lr_schedules import (
    VALID_LR_SCHEDULES,
    LRRangeTest,
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    build_lr_scheduler,
)


def _optimizer(lr: float = 0.1, groups: int = 1, cls=torch.optim.AdamW) -> torch.optim.Optimizer:
    params = [{"params": [torch.nn.Parameter(torch.zeros(2))]} for _ in range(groups)]
    return cls(params, lr=lr)


def _lrs_at(scheduler, optimizer, iterations: list[int]) -> list[float]:
    """The lr in the optimizer after stepping the schedule to each iteration in turn."""
    out = []
    for i in iterations:
        while scheduler.last_batch_iteration < i:
            scheduler.step()
        out.append(optimizer.param_groups[0]["lr"])
    return out


# Independent transcriptions of the reference formulas (i = last_batch_iteration).
def warmup_ref(i, lo, hi, w, kind):
    if i >= w:
        return hi
    gamma = math.log(i + 1) / math.log(w) if kind == "log" else i / w
    return lo + (hi - lo) * gamma


def decay_ref(i, lo, hi, w, t, kind):
    if i < w:
        return warmup_ref(i, lo, hi, w, kind)
    return lo + (hi - lo) * max(0.0, (t - i) / max(1, t - w))


def cosine_ref(i, base, w, t, wmr, cmr, kind):
    if i < w:
        gamma = math.log(i + 1) / math.log(w) if kind == "log" else i / w
        return base * (wmr + (1 - wmr) * gamma)
    progress = min(1.0, (i - w + 1) / max(1, t - w))
    return base * (cmr + (1 - cmr) * (1 + math.cos(math.pi * progress)) / 2)


def one_cycle_ref(i, lo, hi, first, second, decay_rate, decay_size):
    total = first + second
    if i >= total:
        return lo / (1 + decay_rate * (i - total + 1) / decay_size) if decay_size else lo
    x = ((i + 1) / total) % 1.0
    ratio = first / total
    scale = x / ratio if x <= ratio else (x - 1) / (ratio - 1)
    return lo + (hi - lo) * scale


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_lr(kind):
    opt = _optimizer()
    sched = WarmupLR(
        opt, warmup_min_lr=0.01, warmup_max_lr=0.2, warmup_num_steps=8, warmup_type=kind
    )
    steps = [0, 1, 3, 7, 8, 20]
    expected = [warmup_ref(i, 0.01, 0.2, 8, kind) for i in steps]
    assert _lrs_at(sched, opt, steps) == pytest.approx(expected)
    assert sched.get_last_lr() == pytest.approx([0.2]) and sched.get_lr() == pytest.approx([0.2])


def test_warmup_lr_gas_example_sequence():
    """Reference 1.5: log warmup over 10 steps to 1e-3; lr used by optimizer steps 1..5."""
    opt = _optimizer(lr=1e-3)
    sched = WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=1e-3, warmup_num_steps=10)
    seen = []
    for _ in range(5):
        seen.append(opt.param_groups[0]["lr"])  # what optimizer.step() would use now
        sched.step()
    assert seen == pytest.approx([0.0, 0.0, 0.301e-3, 0.477e-3, 0.602e-3], abs=1e-6)
    assert sched.state_dict() == {"last_batch_iteration": 4}


def test_warmup_per_group_and_default_max():
    opt = _optimizer(groups=2)
    opt.param_groups[1]["lr"] = 0.5
    sched = WarmupLR(opt, warmup_min_lr=[0.0, 0.1], warmup_num_steps=4, warmup_type="linear")
    sched.step(2)  # explicit iteration
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.1 * 2 / 4, 0.1 + 0.4 * 2 / 4])
    with pytest.raises(ValueError, match="warmup_max_lr has 3 values.*2 param groups"):
        WarmupLR(opt, warmup_max_lr=[1.0, 2.0, 3.0])


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_decay_lr(kind):
    opt = _optimizer()
    sched = WarmupDecayLR(
        opt, total_num_steps=20, warmup_min_lr=0.0, warmup_max_lr=0.3, warmup_num_steps=5,
        warmup_type=kind,
    )  # fmt: skip
    steps = [0, 2, 4, 5, 11, 19, 20, 25]
    expected = [decay_ref(i, 0.0, 0.3, 5, 20, kind) for i in steps]
    assert _lrs_at(sched, opt, steps) == pytest.approx(expected)
    assert expected[-1] == 0.0


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_cosine_lr(kind):
    opt = _optimizer(lr=0.4)
    sched = WarmupCosineLR(
        opt, total_num_steps=30, warmup_min_ratio=0.1, warmup_num_steps=6, cos_min_ratio=0.05,
        warmup_type=kind,
    )  # fmt: skip
    steps = [0, 1, 5, 6, 10, 17, 29, 30, 40]
    expected = [cosine_ref(i, 0.4, 6, 30, 0.1, 0.05, kind) for i in steps]
    assert _lrs_at(sched, opt, steps) == pytest.approx(expected)
    assert expected[-1] == pytest.approx(0.4 * 0.05)


def test_one_cycle_lr_and_momentum():
    opt = _optimizer()
    sched = OneCycle(
        opt, cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_first_step_size=4,
        cycle_second_step_size=6, decay_lr_rate=0.5, decay_step_size=2,
        cycle_min_mom=0.85, cycle_max_mom=0.95,
    )  # fmt: skip
    assert opt.param_groups[0]["lr"] == pytest.approx(0.01)  # construction: cycle start
    assert opt.param_groups[0]["betas"] == pytest.approx((0.95, 0.999))
    steps = [0, 2, 3, 5, 8, 9, 10, 13]
    expected = [one_cycle_ref(i, 0.01, 0.1, 4, 6, 0.5, 2) for i in steps]
    moms = []
    for i in steps:
        while sched.last_batch_iteration < i:
            sched.step()
        moms.append(opt.param_groups[0]["betas"][0])
        assert opt.param_groups[0]["lr"] == pytest.approx(expected[steps.index(i)])
        assert opt.param_groups[0]["betas"][1] == 0.999  # beta2 untouched
    # momentum moves inversely: peak lr (i = 3) <=> min momentum
    assert moms[steps.index(3)] == pytest.approx(0.85)
    assert moms[steps.index(0)] == pytest.approx(0.95 - 0.1 * 1 / 4)
    assert moms[-1] == pytest.approx(0.95)  # after the cycle without mom decay


def test_one_cycle_stairs_and_sgd_momentum():
    opt = _optimizer(cls=torch.optim.SGD)
    opt.param_groups[0]["momentum"] = 0.9
    sched = OneCycle(
        opt, cycle_min_lr=0.0, cycle_max_lr=1.0, cycle_first_step_size=4, cycle_first_stair_count=2,
    )  # fmt: skip
    lrs = _lrs_at(sched, opt, list(range(8)))
    # positions 1..8 of a 4-up/4-down cycle held on 2 stairs per half
    assert lrs == pytest.approx([0.0, 0.5, 0.5, 1.0, 0.5, 0.5, 0.0, 0.0])
    assert opt.param_groups[0]["momentum"] == pytest.approx(0.9)


@pytest.mark.parametrize("staircase", [False, True])
def test_lr_range_test(staircase):
    opt = _optimizer()
    sched = LRRangeTest(
        opt, lr_range_test_min_lr=0.002, lr_range_test_step_size=4, lr_range_test_step_rate=3.0,
        lr_range_test_staircase=staircase,
    )  # fmt: skip
    assert opt.param_groups[0]["lr"] == pytest.approx(0.002)
    steps = [0, 2, 3, 6, 11]
    interval = [((i + 1) // 4 if staircase else (i + 1) / 4) for i in steps]
    expected = [0.002 * (1 + 3.0 * x) for x in interval]
    assert _lrs_at(sched, opt, steps) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("name", "params"),
    [
        ("WarmupLR", {"warmup_num_steps": 5}),
        ("WarmupDecayLR", {"total_num_steps": 12, "warmup_num_steps": 3}),
        ("WarmupCosineLR", {"total_num_steps": 12, "warmup_num_steps": 3}),
        ("OneCycle", {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 3}),
        ("LRRangeTest", {"lr_range_test_step_size": 3}),
    ],
)
def test_state_dict_round_trip(name, params):
    opt = _optimizer()
    sched = build_lr_scheduler(name.lower(), params, opt)
    for _ in range(7):
        sched.step()
    state = sched.state_dict()
    assert state == {"last_batch_iteration": 6}
    lr_now, betas_now = opt.param_groups[0]["lr"], opt.param_groups[0]["betas"]

    fresh_opt = _optimizer()
    fresh = build_lr_scheduler(name, params, fresh_opt)
    fresh.load_state_dict(state)
    assert fresh_opt.param_groups[0]["lr"] == pytest.approx(lr_now)
    assert fresh_opt.param_groups[0]["betas"] == pytest.approx(betas_now)
    sched.step()
    fresh.step()
    assert fresh.get_last_lr() == pytest.approx(sched.get_last_lr())


def test_tensor_lr_stays_tensor():
    opt = _optimizer()
    opt.param_groups[0]["lr"] = torch.tensor(0.1)
    WarmupLR(opt, warmup_max_lr=0.2, warmup_num_steps=4, warmup_type="linear").step()
    assert isinstance(opt.param_groups[0]["lr"], torch.Tensor)
    assert float(opt.param_groups[0]["lr"]) == pytest.approx(0.0)


def test_errors():
    opt = _optimizer()
    with pytest.raises(ValueError, match=r"'Cosine'.*LRRangeTest, OneCycle, WarmupLR"):
        build_lr_scheduler("Cosine", {}, opt)
    for bad in (0, -3):
        with pytest.raises(ValueError, match="warmup_num_steps"):
            build_lr_scheduler("WarmupLR", {"warmup_num_steps": bad}, opt)
    with pytest.raises(ValueError, match=r"warmup_typ.*accepted keys.*warmup_type"):
        build_lr_scheduler("WarmupLR", {"warmup_typ": "log"}, opt)
    with pytest.raises(ValueError, match=r"needs scheduler.params key\(s\) \['total_num_steps'\]"):
        build_lr_scheduler("WarmupDecayLR", {}, opt)
    with pytest.raises(ValueError, match="warmup_type='cosine'"):
        WarmupLR(opt, warmup_type="cosine")
    assert VALID_LR_SCHEDULES == [
        "LRRangeTest",
        "OneCycle",
        "WarmupLR",
        "WarmupDecayLR",
        "WarmupCosineLR",
    ]
    torch_sched = build_lr_scheduler("StepLR", {"step_size": 2}, opt)
    assert isinstance(torch_sched, torch.optim.lr_scheduler.StepLR)
