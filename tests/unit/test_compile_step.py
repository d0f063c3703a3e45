"""The ``compile`` block and ``engine.compile()``: config, refusals, fallback to eager.

One process; parity of the compiled forward across ranks is in
tests/dist/test_compile_step_dist.py.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from shardspeed.config import ConfigError, load_config
from shardspeed.testing import run_distributed

BASE: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
}


def test_compile_block_keys_parse() -> None:
    block = {"enabled": True, "backend": "aot_eager", "kwargs": {"dynamic": False}}
    cfg = load_config({**BASE, "compile": block})
    assert cfg.compile.enabled and cfg.compile.backend == "aot_eager"
    assert cfg.compile.kwargs == {"dynamic": False}
    assert "compile" not in cfg.ignored_keys


@pytest.mark.parametrize(
    ("block", "stage", "words"),
    [
        ({"deepcompile": True}, 0, ["compile.deepcompile", "DeepCompile", "Fix"]),
        ({"enabld": True}, 0, ["compile.enabld", "did you mean 'enabled'"]),
    ],
)
def test_compile_block_refusals_name_the_key(block: dict, stage: int, words: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        load_config({**BASE, "compile": block, "zero_optimization": {"stage": stage}})
    for word in words:
        assert word in str(info.value)


def test_compile_block_is_accepted_at_stage_3() -> None:
    cfg = load_config({**BASE, "compile": {"enabled": True}, "zero_optimization": {"stage": 3}})
    assert cfg.compile.enabled


def test_deepcompile_knob_is_warned_about_by_name(caplog: pytest.LogCaptureFixture) -> None:
    from shardspeed.utils import logging as ss_logging

    ss_logging._once.cache_clear()
    root = logging.getLogger("shardspeed")
    root.addHandler(caplog.handler)
    try:
        load_config({**BASE, "compile": {"free_activation": True}})
    finally:
        root.removeHandler(caplog.handler)
    assert "'compile.free_activation' has no effect" in caplog.text


def _failing_backend(gm: Any, example_inputs: Any) -> Any:
    raise RuntimeError("backend exploded on purpose")


GRAPHS: list[int] = []


def _counting_backend(gm: Any, example_inputs: Any) -> Any:
    GRAPHS.append(len(example_inputs))
    return gm.forward


class _Mlp(torch.nn.Module):
    """A user module (dynamo skips torch.nn's own containers at the top level)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(4, 8), torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))  # (B, 1)


def _engine_case(case: str) -> Any:
    """Runs in a one-rank process group; returns what the test checks."""
    import shardspeed

    torch.manual_seed(0)
    model = _Mlp()
    x = torch.randn(2, 4)
    eager = float(model(x).sum())
    engine, *_ = shardspeed.initialize(model=model, config=BASE)
    assert not engine.is_compiled
    if case == "fallback":
        records: list[logging.LogRecord] = []
        handler = logging.Handler()
        handler.emit = records.append  # type: ignore[method-assign]
        logging.getLogger("shardspeed").addHandler(handler)
        try:
            engine.compile(backend=_failing_backend)
            assert engine.is_compiled
            out = float(engine(x).sum())
            out_again = float(engine(x).sum())  # eager for good: no second warning
        finally:
            logging.getLogger("shardspeed").removeHandler(handler)
        warnings = [r.getMessage() for r in records if r.levelno == logging.WARNING]
        result = (out, out_again, eager, engine.is_compiled, warnings)
    elif case == "refusals":
        result = []
        for kwargs in (
            {"schedule": [(0, ["z1"])]},
            {"compiled_autograd_enabled": True},
            {"backend": "no_such_backend"},
            {"compile_kwargs": {"no_such_kwarg": 1}},
        ):
            try:
                engine.compile(**kwargs)
                result.append("accepted")
            except ValueError as exc:
                result.append(str(exc))
        result.append(engine.is_compiled)
    else:  # "twice": a counting backend; the second call is a no-op
        engine.compile(backend=_counting_backend, compile_kwargs={"backend": "inductor"})
        state = engine.compile_state
        engine.compile(backend="inductor")
        out = float(engine(x).sum())
        result = (engine.compile_state is state, len(GRAPHS), engine.is_compiled, out, eager)
    engine.destroy()
    return result


def test_compile_failure_falls_back_to_eager_with_one_warning() -> None:
    out, out_again, eager, compiled, warnings = run_distributed(_engine_case, 1, "fallback")[0]
    assert out == pytest.approx(eager) and out_again == pytest.approx(eager)
    assert not compiled
    fallbacks = [w for w in warnings if "running the model eagerly" in w]
    assert len(fallbacks) == 1, warnings
    assert "BackendCompilerFailed" in fallbacks[0] and "exploded on purpose" in fallbacks[0]


def test_engine_compile_refusals_name_the_argument() -> None:
    schedule, autograd, backend, kwarg, compiled = run_distributed(_engine_case, 1, "refusals")[0]
    assert "schedule=" in schedule and "DeepCompile" in schedule
    assert "compiled_autograd_enabled=True" in autograd
    assert "no_such_backend" in backend and "inductor" in backend
    assert "no_such_kwarg" in kwarg
    assert not compiled


def test_engine_compile_twice_is_a_no_op_and_backend_kwarg_is_overridden() -> None:
    same, num_graphs, compiled, out, eager = run_distributed(_engine_case, 1, "twice")[0]
    assert same and compiled
    assert num_graphs == 1  # the forward went through the backend, once
    assert out == pytest.approx(eager)
