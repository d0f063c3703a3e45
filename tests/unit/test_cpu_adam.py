"""Native CPU Adam kernel and DeepSpeedCPUAdam: torch parity, state layout, backend choice.

Tolerance (fp32): the kernel follows torch's AdamW operation by operation except that it
multiplies by 1/sqrt(1 - beta2^t) instead of dividing, so each step may round one
operation differently. After a few steps the parameters and states agree with torch to a
few ulps: ``rtol = 8 * eps`` (~1e-6) and ``atol = 8 * eps * max|reference|`` (a few ulps of
the tensor's scale, for elements where ``p * decay + update`` cancels). The first native
test builds the kernel (~5-20 s, once per machine; cached under the torch extensions dir).
"""

from __future__ import annotations

import copy
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from shardspeed.ops import cpu_adam
from shardspeed.ops.adam import DeepSpeedCPUAdam
from shardspeed.ops.cpu_adam import builder
from shardspeed.testing import run_distributed

EPS32 = torch.finfo(torch.float32).eps
STEPS = 6
LR, BETAS, EPS = 1e-2, (0.9, 0.999), 1e-8


def assert_close_fp32(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Agreement to a few fp32 ulps (see the module docstring)."""
    scale = float(expected.abs().max()) if expected.numel() else 0.0
    torch.testing.assert_close(actual, expected, rtol=8 * EPS32, atol=8 * EPS32 * scale)


@pytest.fixture
def native(monkeypatch: pytest.MonkeyPatch) -> None:
    """Force the native kernel; skip only when the machine has no compiler or ninja."""
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        pytest.skip(f"no C++ compiler ({cxx}) to build the native CPU Adam kernel")
    try:
        with builder._ninja_on_path():
            pass
    except builder.CpuAdamBuildError as err:
        pytest.skip(str(err))
    monkeypatch.setenv(cpu_adam.ENV_VAR, "native")
    assert cpu_adam.select_backend() == "native"  # a build failure here is a test failure


@pytest.fixture
def shardspeed_log() -> Iterator[list[str]]:
    """Messages logged under the ``shardspeed`` logger (it does not propagate to root)."""
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    root = logging.getLogger("shardspeed")
    root.addHandler(handler)
    yield records
    root.removeHandler(handler)


def _problem(numel: int, steps: int = STEPS, seed: int = 0) -> tuple[torch.Tensor, list]:
    gen = torch.Generator().manual_seed(seed)
    p0 = torch.randn(numel, generator=gen)
    grads = [torch.randn(numel, generator=gen) * 0.1 for _ in range(steps)]
    return p0, grads


def _run(opt: torch.optim.Optimizer, param: torch.nn.Parameter, grads: list) -> None:
    for g in grads:
        param.grad = g.clone()
        opt.step()


@pytest.mark.parametrize("numel", [0, 1, 15, 16, 17, 1000, 2 * 32768 + 3])
@pytest.mark.parametrize(
    ("adamw_mode", "weight_decay"), [(True, 0.0), (True, 0.1), (False, 0.0), (False, 0.1)]
)
def test_native_matches_torch(native, numel, adamw_mode, weight_decay):
    p0, grads = _problem(numel)
    ours, ref = torch.nn.Parameter(p0.clone()), torch.nn.Parameter(p0.clone())
    opt = DeepSpeedCPUAdam(
        [ours], lr=LR, betas=BETAS, eps=EPS, weight_decay=weight_decay, adamw_mode=adamw_mode
    )
    ref_cls = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    ref_opt = ref_cls([ref], lr=LR, betas=BETAS, eps=EPS, weight_decay=weight_decay, foreach=False)
    _run(opt, ours, grads)
    _run(ref_opt, ref, grads)
    assert opt.backend == "native"
    assert_close_fp32(ours.detach(), ref.detach())
    for key in ("exp_avg", "exp_avg_sq"):
        assert_close_fp32(opt.state[ours][key], ref_opt.state[ref][key])
    assert float(opt.state[ours]["step"]) == float(ref_opt.state[ref]["step"]) == STEPS


def test_native_without_bias_correction(native):
    p0, grads = _problem(1001)
    ours, ref = torch.nn.Parameter(p0.clone()), p0.clone()
    wd, (b1, b2) = 0.1, BETAS
    opt = DeepSpeedCPUAdam([ours], lr=LR, eps=EPS, weight_decay=wd, bias_correction=False)
    assert opt.param_groups[0]["bias_correction"] is False
    _run(opt, ours, grads)
    m, v = torch.zeros_like(ref), torch.zeros_like(ref)
    for g in grads:  # torch's single-tensor AdamW with both bias corrections = 1
        ref.mul_(1 - LR * wd)
        m.lerp_(g, 1 - b1)
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
        ref.addcdiv_(m, v.sqrt().add_(EPS), value=-LR)
    assert_close_fp32(ours.detach(), ref)
    assert_close_fp32(opt.state[ours]["exp_avg_sq"], v)
    corrected = torch.nn.Parameter(p0.clone())
    _run(DeepSpeedCPUAdam([corrected], lr=LR, eps=EPS, weight_decay=wd), corrected, grads)
    assert not torch.allclose(corrected, ours)  # the flag changes the update


def test_bias_correction_false_errors(native):
    with pytest.raises(ValueError, match="bias_correction=False with amsgrad=True"):
        DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(4))], bias_correction=False, amsgrad=True)
    fp32, fp64 = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(4).double())
    opt = DeepSpeedCPUAdam([fp32, fp64], bias_correction=False)
    fp32.grad, fp64.grad = torch.ones(4), torch.ones(4).double()
    with pytest.raises(ValueError, match=r"contiguous fp32 CPU tensor.*torch.float64"):
        opt.step()
    assert torch.equal(fp32, torch.ones(4))  # checked before anything was stepped


def test_native_threads_give_identical_bits(native):
    p0, grads = _problem(4 * 32768 + 5)
    results = []
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            p = torch.nn.Parameter(p0.clone())
            _run(DeepSpeedCPUAdam([p], lr=LR, weight_decay=0.1), p, grads)
            results.append(p.detach())
    finally:
        torch.set_num_threads(before)
    assert torch.equal(results[0], results[1])


def test_state_layout_and_state_dict_round_trip(native):
    p0, grads = _problem(333)
    a, b = torch.nn.Parameter(p0.clone()), torch.nn.Parameter(p0.clone())
    opt_a = DeepSpeedCPUAdam([a], lr=LR, weight_decay=0.1)
    _run(opt_a, a, grads[:3])
    state = opt_a.state[a]
    assert set(state) == {"step", "exp_avg", "exp_avg_sq"}
    assert state["step"].dtype == torch.float32 and state["step"].dim() == 0
    assert state["exp_avg"].dtype == torch.float32 and state["exp_avg"].shape == a.shape

    b.data.copy_(a.detach())
    opt_b = DeepSpeedCPUAdam([b], lr=LR, weight_decay=0.1)
    # a copy, as torch.save/torch.load gives: torch's load_state_dict keeps the tensors it
    # is given when dtype and device already match, so a live state_dict would be shared
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))
    assert opt_b.param_groups[0]["bias_correction"] is True
    _run(opt_a, a, grads[3:])
    _run(opt_b, b, grads[3:])
    assert torch.equal(a, b)  # same kernel, same inputs: bit-identical
    assert float(opt_b.state[b]["step"]) == len(grads)


def test_resumes_from_a_torch_adamw_checkpoint(native):
    """A state_dict of torch.optim.AdamW loads and continues like AdamW itself."""
    p0, grads = _problem(500)
    ref, ours = torch.nn.Parameter(p0.clone()), torch.nn.Parameter(p0.clone())
    ref_opt = torch.optim.AdamW([ref], lr=LR, weight_decay=0.1, foreach=False)
    _run(ref_opt, ref, grads[:3])
    ours.data.copy_(ref.detach())
    opt = DeepSpeedCPUAdam([ours], lr=LR, weight_decay=0.1)
    opt.load_state_dict(copy.deepcopy(ref_opt.state_dict()))
    _run(ref_opt, ref, grads[3:])
    _run(opt, ours, grads[3:])
    assert_close_fp32(ours.detach(), ref.detach())


def test_ineligible_params_use_torch_kernel(native):
    """fp64 and non-contiguous params and amsgrad groups go through torch's fused Adam."""
    p0, grads = _problem(64)
    fp32 = torch.nn.Parameter(p0.clone())
    fp64 = torch.nn.Parameter(p0.double())
    strided = torch.nn.Parameter(p0.view(8, 8).clone().t())  # non-contiguous
    amsgrad = torch.nn.Parameter(p0.clone())
    groups = [{"params": [fp32, fp64, strided]}, {"params": [amsgrad], "amsgrad": True}]
    opt = DeepSpeedCPUAdam(groups, lr=LR, weight_decay=0.1)
    refs = [torch.nn.Parameter(t.detach().clone()) for t in (fp32, fp64, strided, amsgrad)]
    ref_groups = [{"params": refs[:3]}, {"params": refs[3:], "amsgrad": True}]
    ref_opt = torch.optim.AdamW(ref_groups, lr=LR, weight_decay=0.1, fused=True)
    for g in grads:
        for p in (fp32, fp64, strided, amsgrad, *refs):
            p.grad = g.view(p.shape).to(p.dtype) if p.dim() == 1 else g.view(8, 8).t().clone()
        opt.step()
        ref_opt.step()
    assert_close_fp32(fp32.detach(), refs[0].detach())
    for ours, ref in zip((fp64, strided, amsgrad), refs[1:]):
        assert torch.equal(ours, ref)  # the same torch kernel
    assert "max_exp_avg_sq" in opt.state[amsgrad]
    assert all(p.grad is not None for p in (fp32, fp64, strided, amsgrad))  # grads restored


def test_forced_torch_backend_is_torch_fused(monkeypatch):
    monkeypatch.setenv(cpu_adam.ENV_VAR, "torch")

    def no_build() -> str:
        raise AssertionError("SHARDSPEED_CPU_ADAM=torch must not build the kernel")

    monkeypatch.setattr(builder, "load_cpu_adam", no_build)
    p0, grads = _problem(257)
    ours, ref = torch.nn.Parameter(p0.clone()), torch.nn.Parameter(p0.clone())
    opt = DeepSpeedCPUAdam([ours], lr=LR, weight_decay=0.1)
    _run(opt, ours, grads)
    _run(torch.optim.AdamW([ref], lr=LR, weight_decay=0.1, fused=True), ref, grads)
    assert opt.backend == "torch"
    assert torch.equal(ours, ref)
    with pytest.raises(ValueError, match="bias_correction=False needs the native"):
        DeepSpeedCPUAdam([ours], bias_correction=False)


def _broken_build(monkeypatch: pytest.MonkeyPatch, reason: str) -> None:
    def fail() -> str:
        raise builder.CpuAdamBuildError(reason)

    monkeypatch.setattr(builder, "load_cpu_adam", fail)


def test_forced_native_without_a_build_is_an_error(monkeypatch):
    _broken_build(monkeypatch, "no C++ compiler: simulated")
    monkeypatch.setenv(cpu_adam.ENV_VAR, "native")
    p = torch.nn.Parameter(torch.zeros(8))
    p.grad = torch.ones(8)
    opt = DeepSpeedCPUAdam([p])
    with pytest.raises(RuntimeError) as err:
        opt.step()
    message = str(err.value)
    assert "SHARDSPEED_CPU_ADAM=native" in message and "simulated" in message
    assert "pip install ninja" in message and "unset SHARDSPEED_CPU_ADAM" in message
    assert torch.equal(p, torch.zeros(8))  # nothing was stepped


def test_auto_falls_back_to_torch_and_says_why(monkeypatch, shardspeed_log):
    _broken_build(monkeypatch, "no C++ compiler: simulated for the fallback test")
    monkeypatch.delenv(cpu_adam.ENV_VAR, raising=False)
    p0, grads = _problem(100)
    ours, ref = torch.nn.Parameter(p0.clone()), torch.nn.Parameter(p0.clone())
    opt = DeepSpeedCPUAdam([ours], lr=LR)
    _run(opt, ours, grads)
    _run(torch.optim.AdamW([ref], lr=LR, weight_decay=0.0, fused=True), ref, grads)
    assert opt.backend == "torch" and torch.equal(ours, ref)
    assert any("falling back" in m and "simulated for the fallback" in m for m in shardspeed_log)


def test_invalid_env_value(monkeypatch):
    monkeypatch.setenv(cpu_adam.ENV_VAR, "avx")
    with pytest.raises(ValueError, match=r"SHARDSPEED_CPU_ADAM='avx'.*auto, native, torch"):
        cpu_adam.select_backend()


# -- the build cache ---------------------------------------------------------------------


def test_cache_key_covers_source_flags_compiler_and_cpu():
    base = builder.cache_key(b"src", ["-O3"], "g++ 13", "avx2 fma")
    assert base == builder.cache_key(b"src", ["-O3"], "g++ 13", "avx2 fma")
    assert base != builder.cache_key(b"src2", ["-O3"], "g++ 13", "avx2 fma")
    assert base != builder.cache_key(b"src", ["-O2"], "g++ 13", "avx2 fma")
    assert base != builder.cache_key(b"src", ["-O3"], "g++ 14", "avx2 fma")
    assert base != builder.cache_key(b"src", ["-O3"], "g++ 13", "avx2 avx512f fma")


def test_compiler_flags(monkeypatch):
    monkeypatch.setattr(builder.platform, "machine", lambda: "x86_64")
    assert "-mprefer-vector-width=512" in builder.compiler_flags("avx2 avx512f")
    flags = builder.compiler_flags("avx2 fma")
    assert "-march=native" in flags and "-mprefer-vector-width=512" not in flags
    assert {"-fopenmp", "-ffp-contract=off", "-fno-math-errno"} <= set(flags)
    monkeypatch.setattr(builder.platform, "machine", lambda: "aarch64")
    assert "-mcpu=native" in builder.compiler_flags("asimd")


def test_compile_error_is_a_build_error(native, monkeypatch, tmp_path: Path):
    """A source that does not compile gives CpuAdamBuildError with the compiler's message."""
    source = tmp_path / "cpu_adam.cpp"
    source.write_text("#error shardspeed-simulated-compile-error\n")
    monkeypatch.setattr(builder, "SOURCE", source)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    with pytest.raises(builder.CpuAdamBuildError, match="shardspeed-simulated-compile-error"):
        builder._build_and_load()


def test_stale_torch_lock_is_removed(tmp_path: Path):
    (tmp_path / "lock").touch()  # left by a build that was killed
    with builder._build_lock(tmp_path):
        assert not (tmp_path / "lock").exists()


# -- the engines pick it with offload_optimizer ---------------------------------------------


def _engine_optimizer(torch_adam: bool) -> tuple[str, bool | None]:
    import shardspeed

    config = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": torch_adam}},
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
    }
    engine, *_ = shardspeed.initialize(model=torch.nn.Linear(4, 4), config=config)
    opt = engine.basic_optimizer
    out = (type(opt).__name__, getattr(opt, "adamw_mode", None))
    engine.destroy()
    return out


def _both_engines() -> list[tuple[str, bool | None]]:
    return [_engine_optimizer(torch_adam=False), _engine_optimizer(torch_adam=True)]


def test_offload_optimizer_engine_uses_deepspeed_cpu_adam():
    """``offload_optimizer`` builds DeepSpeedCPUAdam; ``torch_adam: true`` keeps torch's."""
    assert run_distributed(_both_engines, 1) == [[("DeepSpeedCPUAdam", True), ("AdamW", None)]]
