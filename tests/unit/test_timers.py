"""Timers and ThroughputTimer."""

from __future__ import annotations

import time

import pytest

from shardspeed.profiling import ENGINE_TIMER_NAMES, ThroughputTimer, Timers


def _advance(timers: Timers, name: str, seconds: float) -> None:
    """Record an interval of exactly ``seconds`` without sleeping."""
    timer = timers(name)
    timer.start()
    timer._start -= seconds
    timer.stop()


def test_named_timers_accumulate_and_reset():
    timers = Timers(synchronize=False)
    _advance(timers, "forward", 0.010)
    _advance(timers, "forward", 0.030)
    assert timers.has("forward") and "forward" in timers and not timers.has("step")
    assert timers("forward").count == 2
    assert timers("forward").mean() == pytest.approx(20.0, abs=0.5)
    assert timers("forward").elapsed(reset=False) == pytest.approx(40.0, abs=0.5)
    assert timers("forward").elapsed() == pytest.approx(40.0, abs=0.5)  # resets
    assert timers("forward").elapsed() == 0.0

    timers("step").start()
    time.sleep(0.002)
    assert timers("step").elapsed(reset=False) > 0  # running interval included
    timers("step").stop()
    with pytest.raises(RuntimeError, match="stopped without start"):
        timers("step").stop()
    timers("step").start()
    with pytest.raises(RuntimeError, match="started twice"):
        timers("step").start()


def test_log_line_format_normalizer_and_reset():
    timers = Timers(synchronize=False)
    for name, seconds in (("forward", 0.012), ("backward", 0.024), ("step", 0.006)):
        _advance(timers, name, seconds)
    line = timers.log(["forward", "backward", "allgather", "step"], normalizer=2.0)
    parts = line.split(" | ")
    assert [p.split(":")[0] for p in parts] == ["forward", "backward", "step"]  # unknown skipped
    values = [float(p.split(": ")[1].removesuffix(" ms")) for p in parts]
    assert values == pytest.approx([6.0, 12.0, 3.0], abs=0.3)
    assert all(p.endswith(" ms") for p in parts)
    assert timers.get_mean(["forward"]) == {"forward": 0.0}  # log(reset=True) cleared it
    with pytest.raises(ValueError, match="normalizer"):
        timers.get_mean(["forward"], normalizer=0)
    assert set(ENGINE_TIMER_NAMES) == {
        "forward",
        "backward",
        "backward_inner",
        "backward_reduce",
        "step",
        "allgather",
    }


def test_throughput_timer_skips_warmup_and_reports_rates():
    messages: list[str] = []
    tput = ThroughputTimer(
        batch_size=8, seq_length=16, start_step=2, steps_per_output=2, logging_fn=messages.append
    )
    for _ in range(5):
        tput.start()
        tput._timer._start -= 0.1  # each step "takes" 100 ms
        tput.stop(global_step=True)
    # step 1 is warm-up; steps 2..5 are counted
    assert tput.global_step_count == 5
    assert tput.total_samples == 32
    assert tput.avg_samples_per_sec() == pytest.approx(80.0, rel=0.05)
    assert tput.avg_tokens_per_sec() == pytest.approx(80.0 * 16, rel=0.05)
    assert tput.samples_per_sec() == pytest.approx(80.0, rel=0.05)
    assert len(messages) == 2 and "samples/s" in messages[0] and "tokens/s" in messages[0]

    tput.start()
    tput.stop(global_step=False)  # micro-step: not counted
    assert tput.global_step_count == 5
    with pytest.raises(ValueError, match="batch_size"):
        ThroughputTimer(batch_size=0)
