"""ZeRO-3 per-unit compile (``runtime/compile_units.py``): targets, refusals, fallback.

One process. Parity of compiled ZeRO-3 training on 2 ranks is in
tests/dist/test_compile_zero3_dist.py.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
import torch.nn as nn

from shardspeed.runtime.compile_step import CompileState, compile_zero3_units
from shardspeed.runtime.compile_units import compile_targets
from shardspeed.testing import run_distributed
from shardspeed.zero.fetch import Unit


class _Tanh(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))  # (B, 4)


class _Relu(_Tanh):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x))  # (B, 4)


class _Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Tanh(), _Relu(), _Tanh()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.sum(-1)  # (B,)


def _units(model: _Stack) -> list[Unit]:
    units = [Unit(0, "", model, is_root=True)]
    units += [Unit(i + 1, f"layers.{i}", m, False) for i, m in enumerate(model.layers)]
    return units


def _no_tanh_backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
    """Compiles graphs without tanh; refuses the rest (a unit class that does not compile)."""
    if any(node.target in (torch.tanh, torch.ops.aten.tanh.default) for node in gm.graph.nodes):
        raise RuntimeError("no tanh here")
    return gm.forward


def test_targets_are_the_non_root_units_or_the_root_alone() -> None:
    model = _Stack()
    assert [name for name, _ in compile_targets(_units(model))] == [
        "layers.0",
        "layers.1",
        "layers.2",
    ]
    root_only = [Unit(0, "", model, is_root=True)]
    assert [m for _, m in compile_targets(root_only)] == [model]


@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
def test_cuda_graph_modes_are_refused_at_stage_3(mode: str) -> None:
    with pytest.raises(ValueError) as info:
        compile_zero3_units(_units(_Stack()), "eager", {"mode": mode})
    for word in (f"mode={mode!r}", "CUDA graphs", "stage 3", "Fix: change compile.kwargs.mode"):
        assert word in str(info.value)


def test_unknown_backend_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match="no_such_backend.*Allowed backends"):
        compile_zero3_units(_units(_Stack()), "no_such_backend", {})


def test_a_unit_class_that_fails_runs_eagerly_the_others_stay_compiled(
    caplog: pytest.LogCaptureFixture,
) -> None:
    torch.manual_seed(0)
    model = _Stack()
    x = torch.randn(2, 4)
    eager = model(x)
    root = logging.getLogger("shardspeed")
    root.addHandler(caplog.handler)
    try:
        state, units = compile_zero3_units(_units(model), _no_tanh_backend, {"dynamic": False})
        out = model(x)
        again = model(x)
    finally:
        root.removeHandler(caplog.handler)
    torch.testing.assert_close(out, eager)
    torch.testing.assert_close(again, eager)
    warnings = [r.getMessage() for r in caplog.records if "running _Tanh units" in r.getMessage()]
    assert len(warnings) == 1, caplog.text
    assert "layers.0" in warnings[0] and "no tanh here" in warnings[0]
    assert set(state.unit_fallbacks) == {"_Tanh"}
    assert state.active  # _Relu is still compiled
    calls = [f.num_compiled_calls for f in units.forwards]
    assert calls == [0, 2, 0]
    units.remove()
    assert "forward" not in model.layers[0].__dict__
    torch.testing.assert_close(model(x), eager)


def _failing_backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
    raise RuntimeError("backend exploded on purpose")


def test_all_units_failing_marks_the_state_fallen_back() -> None:
    model = _Stack()
    x = torch.randn(2, 4)
    state, _ = compile_zero3_units(_units(model), _failing_backend, {})
    torch.testing.assert_close(model(x), _Stack.forward(model, x))
    assert not state.active and isinstance(state, CompileState)
    assert "exploded on purpose" in str(state.fallback_reason)


def _engine_fallback_at_stage_3() -> tuple[float, float, bool, list[str], bool]:
    """One rank, ZeRO-3: a failing backend leaves the engine eager with one warning."""
    import shardspeed

    torch.manual_seed(0)
    model = _Stack()
    x = torch.randn(2, 4)
    eager = float(model(x).sum())
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    engine, *_ = shardspeed.initialize(model=model, config=config)
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("shardspeed").addHandler(handler)
    try:
        engine.compile(backend=_failing_backend)
        compiled_before = engine.is_compiled
        out = float(engine(x).sum())
    finally:
        logging.getLogger("shardspeed").removeHandler(handler)
    warnings = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    result = (out, eager, engine.is_compiled, warnings, compiled_before)
    engine.destroy()
    return result


def test_engine_at_stage_3_falls_back_with_a_logged_reason() -> None:
    out, eager, compiled, warnings, compiled_before = run_distributed(
        _engine_fallback_at_stage_3, 1
    )[0]
    assert compiled_before and not compiled
    assert out == pytest.approx(eager)
    fallbacks = [w for w in warnings if "units eagerly" in w]
    assert len(fallbacks) == 2, warnings  # one per unit class (_Tanh, _Relu)
    assert all("exploded on purpose" in w for w in fallbacks)


@pytest.mark.parametrize(("dynamic", "max_graphs"), [(None, 2), (False, 3)])
def test_recompiles_under_changing_shapes_are_bounded(
    dynamic: bool | None, max_graphs: int
) -> None:
    """Automatic dynamic shapes (the default): one recompile marks the changed dim dynamic;
    dynamic=False: one graph per shape. The three units share their graphs either way."""
    import torch._dynamo

    torch._dynamo.reset()
    graphs: list[int] = []

    def counting(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        graphs.append(len(example_inputs))
        return gm.forward

    model = nn.Sequential(*[_Relu() for _ in range(3)])
    units = [Unit(0, "", model, is_root=True)]
    units += [Unit(i + 1, str(i), m, False) for i, m in enumerate(model)]
    _, compiled = compile_zero3_units(units, counting, {"dynamic": dynamic})
    for batch in (2, 3, 5):  # an input that requires grad, as a block's input in training
        model(torch.randn(batch, 4, requires_grad=True))
    assert len(graphs) == max_graphs
    assert compiled.num_compiled_calls == 9
