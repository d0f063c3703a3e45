"""Loss scalers: DeepSpeed's dynamic-scaling rules, errors, state, config mapping."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from shardspeed.precision.loss_scaler import (
    DynamicLossScaler,
    LossScaleMinimumError,
    LossScaler,
    NoOpLossScaler,
    StaticLossScaler,
    build_loss_scaler,
)


def _run(scaler: DynamicLossScaler, overflows: str) -> list[float]:
    """Feed updates ('x' = overflow, '.' = clean); return the scale after each."""
    scales = []
    for mark in overflows:
        scaler.update(mark == "x")
        scales.append(scaler.loss_scale)
    return scales


def test_growth_after_window():
    scaler = DynamicLossScaler(init_scale=8.0, scale_window=3)
    # DeepSpeed counts clean updates *before* the current one: first growth on the 4th.
    assert _run(scaler, "......") == [8, 8, 8, 16, 16, 16]
    assert _run(scaler, "...") == [32, 32, 32]


def test_backoff_on_overflow_and_window_restarts():
    scaler = DynamicLossScaler(init_scale=2**16, scale_window=2, hysteresis=1)
    assert _run(scaler, "x") == [2**15]
    assert _run(scaler, "...x..") == [2**15, 2**15, 2**16, 2**15, 2**15, 2**15]
    assert scaler.num_overflows == 2 and scaler.num_updates == 7


def test_hysteresis_delays_backoff_and_is_not_refilled_by_clean_steps():
    scaler = DynamicLossScaler(init_scale=1024.0, scale_window=100, hysteresis=3)
    assert _run(scaler, "x.x") == [1024, 1024, 1024]
    assert scaler.cur_hysteresis == 1
    assert _run(scaler, "x.x") == [512, 512, 256]  # exhausted: every overflow halves


def test_consecutive_hysteresis_refills_on_each_clean_step():
    plain = DynamicLossScaler(init_scale=1024.0, hysteresis=2)
    consecutive = DynamicLossScaler(init_scale=1024.0, hysteresis=2, consecutive_hysteresis=True)
    assert _run(plain, "x.x") == [1024, 1024, 512]
    assert _run(consecutive, "x.x.x") == [1024] * 5
    assert _run(consecutive, ".xx") == [1024, 1024, 512]  # two overflows in a row still halve


def test_minimum_scale_error_and_opt_out():
    scaler = DynamicLossScaler(init_scale=4.0, hysteresis=1, min_scale=1.0)
    assert _run(scaler, "xx") == [2.0, 1.0]  # reaching the minimum is fine
    with pytest.raises(LossScaleMinimumError) as err:
        scaler.update(True)
    message = str(err.value)
    assert "minimum loss scale 1" in message and "inf/nan" in message and "bf16" in message
    tolerant = DynamicLossScaler(init_scale=2.0, hysteresis=1, raise_error_at_min_scale=False)
    assert _run(tolerant, "xxx") == [1.0, 1.0, 1.0]


def test_state_dict_round_trip():
    scaler = DynamicLossScaler(init_scale=64.0, scale_window=3, hysteresis=2)
    _run(scaler, "x..x.")
    restored = DynamicLossScaler(init_scale=64.0, scale_window=3, hysteresis=2)
    restored.load_state_dict(scaler.state_dict())
    assert restored.state_dict() == scaler.state_dict()
    assert _run(restored, "..x..") == _run(scaler, "..x..")
    static = StaticLossScaler(128.0)
    other = StaticLossScaler(1.0)
    other.load_state_dict(static.state_dict())
    assert other.loss_scale == 128.0


def test_build_loss_scaler_from_config():
    assert isinstance(build_loss_scaler(None), NoOpLossScaler)
    assert build_loss_scaler(SimpleNamespace(enabled=False, loss_scale=0)).loss_scale == 1.0
    static = build_loss_scaler(SimpleNamespace(enabled=True, loss_scale=512))
    assert isinstance(static, StaticLossScaler) and not static.dynamic and static.loss_scale == 512
    cfg = SimpleNamespace(
        enabled=True, loss_scale=0, initial_scale_power=8, loss_scale_window=50, hysteresis=4,
        consecutive_hysteresis=True, min_loss_scale=0.5,
    )  # fmt: skip
    dyn = build_loss_scaler(cfg)
    assert isinstance(dyn, DynamicLossScaler) and dyn.dynamic
    assert (dyn.loss_scale, dyn.scale_window, dyn.hysteresis, dyn.min_scale) == (256, 50, 4, 0.5)
    assert dyn.consecutive_hysteresis
    defaults = build_loss_scaler(SimpleNamespace(enabled=True))
    assert (defaults.loss_scale, defaults.scale_window, defaults.hysteresis) == (2**16, 1000, 2)
    for scaler in (dyn, static, NoOpLossScaler()):
        assert isinstance(scaler, LossScaler)
    noop = NoOpLossScaler()
    noop.update(True)
    assert noop.loss_scale == 1.0


def test_invalid_arguments_are_named():
    with pytest.raises(ValueError, match="fp16.loss_scale_window=0"):
        DynamicLossScaler(scale_window=0)
    with pytest.raises(ValueError, match="below fp16.min_loss_scale"):
        DynamicLossScaler(init_scale=1.0, min_scale=4.0)
    with pytest.raises(ValueError, match="fp16.loss_scale=-1"):
        StaticLossScaler(-1)


def test_one_log_line_per_overflow():
    records: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    handler = Collect()
    logger = logging.getLogger("shardspeed")
    logger.addHandler(handler)
    try:
        scaler = DynamicLossScaler(init_scale=2**16, hysteresis=2)
        _run(scaler, "x.x...")
    finally:
        logger.removeHandler(handler)
    overflow_lines = [r for r in records if r.startswith("fp16 overflow")]
    assert len(overflow_lines) == 2
    assert "loss scale 65536 kept (hysteresis 2 -> 1)" in overflow_lines[0]
    assert "skipping step, loss scale 65536 -> 32768" in overflow_lines[1]
