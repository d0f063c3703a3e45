"""A 16-bit engine on a CPU without oneDNN kernels for the dtype says, once, that its matrix
products take torch's slow path there, and how to avoid it; elsewhere it says nothing."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from shardspeed.precision import cpu_support
from shardspeed.testing import run_distributed


def _capture() -> tuple[logging.Handler, list[logging.LogRecord]]:
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("shardspeed").addHandler(handler)
    return handler, records


def test_warns_once_with_the_dtype_and_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu_support._warn.cache_clear()
    monkeypatch.setattr(cpu_support, "has_fast_16bit_matmul", lambda dtype: False)
    handler, records = _capture()
    try:
        assert cpu_support.warn_if_slow(torch.bfloat16, torch.device("cpu"))
        assert cpu_support.warn_if_slow(torch.bfloat16, torch.device("cpu"))
        assert not cpu_support.warn_if_slow(torch.bfloat16, torch.device("meta"))
    finally:
        logging.getLogger("shardspeed").removeHandler(handler)
        cpu_support._warn.cache_clear()
    warnings = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "bf16 training on this CPU" in warnings[0] and "'bf16' block" in warnings[0]


def test_fp32_is_always_fast() -> None:
    assert cpu_support.has_fast_16bit_matmul(torch.float32)
    assert not cpu_support.warn_if_slow(torch.float32, torch.device("cpu"))


def _engine_warnings(dtype_block: str, fast: bool) -> list[str]:
    import shardspeed

    cpu_support._warn.cache_clear()
    cpu_support.has_fast_16bit_matmul = lambda dtype: fast  # this rank's process only
    handler, records = _capture()
    try:
        config: dict[str, Any] = {"train_micro_batch_size_per_gpu": 2}
        if dtype_block:
            config[dtype_block] = {"enabled": True}
        engine, *_ = shardspeed.initialize(
            model=torch.nn.Linear(4, 4), config=config, optimizer=None
        )
        engine.destroy()
    finally:
        logging.getLogger("shardspeed").removeHandler(handler)
    return [r.getMessage() for r in records if "training on this CPU" in r.getMessage()]


@pytest.mark.parametrize(
    ("block", "fast", "warned"),
    [("bf16", False, True), ("fp16", False, True), ("bf16", True, False), ("", False, False)],
)
def test_engine_warns_where_the_cpu_is_slow(block: str, fast: bool, warned: bool) -> None:
    warnings = run_distributed(_engine_warnings, 1, block, fast)[0]
    assert bool(warnings) == warned, warnings
