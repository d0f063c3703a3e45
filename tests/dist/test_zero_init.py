"""``zero.Init``: partitioning during construction, adoption by the stage-3 engine, limits.

* parity: the parity GPT (tied wte/lm_head) built under ``zero.Init`` trains to bit-identical
  losses and parameters as the same model built without it (fp32 and bf16, stage 3, world
  2 and 4), also with a frozen parameter and ``GatheredParameters(modifier_rank=0)`` edits
  made inside and after the context; the plain build itself matches the one-process
  reference (``test_zero3_parity``'s tolerance);
* construction: ranks agree (rank 0's values), nested modules / classes defined inside the
  context / nested contexts / ``Init(module=...)`` / ``enabled=False`` / ``remote_device``
  and ``dtype``; patched ``__init__``s and ``torch.nn.init`` are restored, also after an
  exception; below stage 3 the model is gathered back (with a warning);
* memory: a 128 MiB fp32 model built under ``zero.Init`` on 4 ranks (kernel peak-RSS
  high-water mark, reset before construction) grows each rank by less than half of it,
  while building it plainly grows each rank by the whole model; one training step works;
* errors for unsupported options.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.nn as nn
from parity_common import ParitySpec, make_model, reference_run, train_steps
from test_zero3_parity import zero3_spec
from test_zero_parity import tolerance

from shardspeed.testing import run_distributed


# -- parity -----------------------------------------------------------------------------------
def _edit(model: nn.Module, name: str, rank_zero_only: bool) -> None:
    """The edits both builds apply: in place, on dp rank 0 (Init) or on every rank (plain)."""
    from shardspeed import comm
    from shardspeed.zero import GatheredParameters

    param = dict(model.named_parameters(remove_duplicate=False))[name]
    with GatheredParameters(param, modifier_rank=0):
        if not rank_zero_only or comm.get_rank() == 0:
            with torch.no_grad():
                param.mul_(-2.0)  # exact in every float format


def _build(spec: ParitySpec, use_init: bool, variant: str) -> nn.Module:
    from shardspeed import zero

    edits = variant == "edits"
    with zero.Init(config_dict_or_path=spec.config(), enabled=use_init):
        model = make_model(spec)
        if edits:  # inside the context, on the last-built module's and the tied weight
            _edit(model, "ln_f.weight", rank_zero_only=use_init)
            _edit(model, "lm_head.weight", rank_zero_only=use_init)
    if use_init:
        params = list(model.parameters())
        assert all(p.numel() == 0 and p.ds_tensor.dtype == spec_dtype(spec) for p in params)
        assert model.lm_head.weight is model.wte.weight
    if edits:  # after the context, before initialize()
        _edit(model, "h.0.mlp.c_fc.weight", rank_zero_only=use_init)
        model.wpe.weight.requires_grad_(False)  # frozen: kept whole by the engine
    return model


def spec_dtype(spec: ParitySpec) -> torch.dtype:
    return {"fp32": torch.float32, "bf16": torch.bfloat16}[spec.precision]


def _train(model: nn.Module, spec: ParitySpec) -> tuple[list[float], dict[str, torch.Tensor]]:
    import shardspeed
    from shardspeed.zero import GatheredParameters

    engine, _, _, _ = shardspeed.initialize(model=model, config=spec.config())
    assert not any(hasattr(p, "_ss_init") for p in model.parameters())  # pieces adopted
    losses = train_steps(engine, spec, range(spec.steps))
    with GatheredParameters(list(model.parameters())):
        final = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    engine.destroy()
    return losses, final


def _parity_specs(world: int) -> list[tuple[ParitySpec, str]]:
    base = zero3_spec(world, "fp32", 1)
    base.steps = 3
    cases = [(base, "plain"), (base, "edits")]
    if world == 2:
        bf16 = zero3_spec(world, "bf16", 1, stage3_param_persistence_threshold=100)
        bf16.steps = 3
        cases.append((bf16, "edits"))  # dtype from the config; persistent small params
    return cases


def _parity_runs(world: int) -> list:
    out = []
    for spec, variant in _parity_specs(world):
        plain = _train(_build(spec, False, variant), spec)
        partitioned = _train(_build(spec, True, variant), spec)
        out.append((plain, partitioned))
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_model_built_under_init_trains_identically(world: int) -> None:
    specs = _parity_specs(world)
    per_rank = run_distributed(_parity_runs, world, world, timeout=300)
    for i, (spec, variant) in enumerate(specs):
        for rank, results in enumerate(per_rank):
            (plain_losses, plain), (init_losses, init) = results[i]
            label = f"{variant} {spec.precision} world={world} rank={rank}"
            assert plain_losses == init_losses, label
            assert plain.keys() == init.keys()
            for name in plain:
                assert torch.equal(plain[name], init[name]), f"{label}: {name}"
        if variant == "plain":  # the plain build is ordinary stage-3 training
            ref_losses, ref_params = reference_run(spec)
            losses, params = per_rank[0][i][1]
            torch.testing.assert_close(
                torch.tensor(losses), torch.tensor(ref_losses), **tolerance(spec)
            )
            for name, ref in ref_params.items():
                torch.testing.assert_close(params[name], ref, **tolerance(spec))
        if variant == "edits":  # the frozen parameter was not trained
            initial = per_rank[0][i][0][1]["wpe.weight"]
            torch.testing.assert_close(initial, _initial_wpe(spec), rtol=0, atol=0)


def _initial_wpe(spec: ParitySpec) -> torch.Tensor:
    return make_model(spec).wpe.weight.detach().to(spec_dtype(spec)).float()


# -- construction behaviour ---------------------------------------------------------------------
class Pair(nn.Module):
    """Two linears whose parent re-initialises a child's weight with torch.nn.init."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 7)
        self.b = nn.Linear(7, 3)
        nn.init.xavier_uniform_(self.b.weight)
        self.scale = nn.Parameter(torch.randn(3))


class Doubled(nn.Linear):
    """A subclass editing in its own __init__ what its parent created (before partitioning)."""

    def __init__(self) -> None:
        super().__init__(4, 4, bias=False)
        with torch.no_grad():
            self.weight.mul_(2.0)


def _gathered(module: nn.Module) -> dict[str, torch.Tensor]:
    from shardspeed.zero import GatheredParameters

    with GatheredParameters(list(module.parameters())):
        return {n: p.detach().clone() for n, p in module.named_parameters()}


def _construction() -> dict[str, object]:
    from shardspeed import comm, zero
    from shardspeed.zero.init_partition import is_init_partitioned

    rank = comm.get_rank()
    originals = (nn.Linear.__init__, nn.Module.__init__, torch.nn.init.normal_)
    out: dict[str, object] = {}

    torch.manual_seed(rank)  # different random state per rank: dp rank 0's values win
    with zero.Init():
        pair = Pair()
        assert all(p.numel() == 0 for p in pair.parameters())
        with zero.Init(dtype=torch.bfloat16, remote_device="cpu"):  # nested: innermost applies
            doubled = Doubled()

        class Defined(nn.Module):  # a class defined inside the context
            def __init__(self) -> None:
                super().__init__()
                self.w = nn.Parameter(torch.full((6,), float(rank)))

        defined = Defined()
        assert is_init_partitioned(pair.a.weight), "the outer context is still active"
    out["restored"] = originals == (nn.Linear.__init__, nn.Module.__init__, torch.nn.init.normal_)
    out["defined_unwrapped"] = not hasattr(Defined.__init__, "__wrapped__")
    out["plain_after_exit"] = not is_init_partitioned(nn.Linear(2, 2).weight)
    out["pair"] = _gathered(pair)
    out["defined"] = _gathered(defined)["w"]
    out["doubled"] = (_gathered(doubled)["weight"], doubled.weight.ds_tensor.dtype,
                      doubled.weight.ds_tensor.device.type)  # fmt: skip
    out["attrs"] = {
        "ds_shape": tuple(pair.a.weight.ds_shape),
        "ds_numel": pair.a.weight.ds_numel,
        "ds_tensor": pair.a.weight.ds_tensor.numel(),
        "status": pair.a.weight.ds_status.name,
        "persist": pair.a.weight.ds_persist,
        "ids_unique": len({p.ds_id for p in [*pair.parameters(), *defined.parameters()]}) == 6,
    }

    try:  # an exception inside the context restores everything
        with zero.Init():
            nn.Linear(3, 3)
            raise KeyError("boom")
    except KeyError:
        pass
    out["restored_after_error"] = nn.Linear.__init__ is originals[0]

    torch.manual_seed(0)
    existing = Pair()
    expected = {n: p.detach().clone() for n, p in existing.named_parameters()}
    zero.Init(module=existing)  # partition an existing module
    out["existing"] = (all(p.numel() == 0 for p in existing.parameters()), expected,
                       _gathered(existing))  # fmt: skip
    with zero.Init(enabled=False):
        out["disabled"] = not is_init_partitioned(nn.Linear(2, 2).weight)
    return out


def test_construction_partitions_each_module_and_restores_patches() -> None:
    torch.manual_seed(0)
    ref = Pair()  # rank 0's random stream
    ref_doubled = Doubled().weight.detach().to(torch.bfloat16)
    for got in run_distributed(_construction, 2, timeout=60):
        assert got["restored"] and got["restored_after_error"] and got["plain_after_exit"]
        assert got["defined_unwrapped"] and got["disabled"]
        for name, value in ref.named_parameters():  # incl. the parent's xavier_uniform_
            assert torch.equal(got["pair"][name], value.detach()), name
        assert torch.equal(got["defined"], torch.zeros(6))  # rank 0's value on every rank
        weight, dtype, device = got["doubled"]
        assert torch.equal(weight, ref_doubled)  # edited by the subclass before partitioning
        assert dtype == torch.bfloat16 and device == "cpu"
        assert got["attrs"] == {
            "ds_shape": (7, 5),
            "ds_numel": 35,
            "ds_tensor": 18,
            "status": "NOT_AVAILABLE",
            "persist": False,
            "ids_unique": True,
        }
        partitioned, expected, gathered = got["existing"]
        assert partitioned
        for name, value in expected.items():
            assert torch.equal(gathered[name], value), name


# -- other stages, external parameters ------------------------------------------------------------
class Mix(nn.Module):
    """Two units; the root's forward also uses layer 0's weight (registered as external)."""

    def __init__(self) -> None:
        from shardspeed import zero

        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
        zero.register_external_parameter(self, self.layers[0].weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.layers[0](x))
        return (self.layers[1](h) + nn.functional.linear(h, self.layers[0].weight)).pow(2).mean()


def _train_mix(
    stage: int, use_init: bool, init_kwargs: dict | None = None, zero_extra: dict | None = None
) -> tuple[Any, dict[str, torch.Tensor]]:
    """Mix trained 2 steps; (the engine's ZeRO++ policy at stage 3 else None, parameters)."""
    import shardspeed
    from shardspeed import comm, zero

    torch.manual_seed(3)
    with zero.Init(enabled=use_init, **(init_kwargs or {})):
        model = Mix()
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {
            "stage": stage, "stage3_param_persistence_threshold": 0, **(zero_extra or {})
        },
    }  # fmt: skip
    engine, _, _, _ = shardspeed.initialize(model=model, config=config)
    policy = getattr(engine.sharding, "zeropp_policy", None)
    gen = torch.Generator().manual_seed(comm.get_rank())
    for _ in range(2):
        engine.backward(engine(torch.randn(4, 8, generator=gen)))
        engine.step()
    out = _gathered(model)
    engine.destroy()
    return policy, out


def _other_stages() -> tuple[list, list[str]]:
    import logging

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    log = logging.getLogger("shardspeed.zero.init_partition")
    log.addHandler(handler)
    try:
        runs = [(_train_mix(stage, False)[1], _train_mix(stage, True)[1]) for stage in (2, 3)]
    finally:
        log.removeHandler(handler)
    return runs, [r.getMessage() for r in records if r.levelno == logging.WARNING]


def test_init_model_at_stage_2_is_gathered_and_external_params_work_at_stage_3() -> None:
    for results, warnings in run_distributed(_other_stages, 2, timeout=60):
        for plain, partitioned in results:
            for name in plain:
                assert torch.equal(plain[name], partitioned[name]), name
        assert len(warnings) == 1, warnings  # stage 2 only: stage 3 adopts the pieces
        assert "ZeRO stage 2" in warnings[0] and "whole on each rank" in warnings[0]


def _qwz_runs() -> dict[str, tuple[bool, dict[str, torch.Tensor]]]:
    """Mix at stage 3 with qwZ from the Init argument, the config key, or off."""
    runs = {}
    for via in ("init", "config", "off"):
        policy, out = _train_mix(
            3, True, {"zero_quantized_weights": via == "init"},
            {"zero_quantized_weights": True} if via == "config" else None,
        )  # fmt: skip
        runs[via] = (policy.quantized_weights, out)
    return runs


def test_init_quantized_weights_turns_qwz_on_like_the_config_key() -> None:
    """DeepSpeed ORs zero.Init(zero_quantized_weights=True) with the config key: the engine's
    stage-3 gathers are quantized either way, with the same results."""
    for runs in run_distributed(_qwz_runs, 2, timeout=90):
        assert runs["init"][0] and runs["config"][0] and not runs["off"][0]
        init, config, off = runs["init"][1], runs["config"][1], runs["off"][1]
        for name in init:
            assert torch.equal(init[name], config[name]), name
        assert any(not torch.equal(init[n], off[n]) for n in init)  # quantization acted


def test_unsupported_options_raise_value_errors() -> None:
    from shardspeed import zero

    cases = [
        ({"remote_device": "nvme"}, "offload_param"),
        ({"remote_device": "disk"}, "allowed: None"),
        ({"zero_quantized_nontrainable_weights": True}, "nontrainable_weights=True"),
        ({"sequence_data_parallel_group": object()}, "sequence_data_parallel_group"),
        ({"param_swapper": object()}, "param_swapper"),
        ({"dtype": torch.int8}, "floating-point dtype"),
        ({"dtype": "fp8"}, "zero.Init(dtype)='fp8'"),
    ]
    for kwargs, needle in cases:
        with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")):
            zero.Init(**kwargs)
    zero.Init(remote_device="nvme", enabled=False)  # disabled: a no-op, nothing checked


# -- memory -----------------------------------------------------------------------------------------
LAYERS, WIDTH = 16, 1448  # 16 x 1448 x 1448 fp32 = 128 MiB
M_MMAP_THRESHOLD = -3  # glibc mallopt parameter


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith(key + ":"))
    return int(line.split()[1]) * 1024


def _peak_growth(fn):  # noqa: ANN001, ANN202 - test helper
    """(fn(), peak RSS during fn - RSS before): the kernel's high-water mark, reset first."""
    before = _status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS (Linux >= 4.0)
    result = fn()
    return result, _status_kib("VmHWM") - before


def _stack() -> nn.Sequential:
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)])


def _memory() -> dict[str, float]:
    import ctypes
    import gc

    import shardspeed
    from shardspeed import zero

    libc = ctypes.CDLL("libc.so.6")
    # Large allocations straight from mmap, so freed tensors leave RSS at once and RSS growth
    # is the live memory, whatever heap this warm worker accumulated in earlier tests.
    libc.mallopt(M_MMAP_THRESHOLD, 1 << 20)
    try:
        gc.collect()
        torch.manual_seed(0)

        def build_partitioned() -> nn.Module:
            with zero.Init():
                return _stack()

        model, init_growth = _peak_growth(build_partitioned)
        config = {
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        }
        engine, _, _, _ = shardspeed.initialize(model=model, config=config)
        loss = engine(torch.randn(2, WIDTH)).pow(2).mean()
        engine.backward(loss)
        engine.step()
        engine.destroy()
        del engine, model
        gc.collect()
        plain, plain_growth = _peak_growth(_stack)
        del plain
        return {"init": init_growth, "plain": plain_growth, "loss": float(loss.detach())}
    finally:
        libc.mallopt(M_MMAP_THRESHOLD, 128 * 1024)  # glibc's initial threshold


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK), reason="needs Linux /proc")
def test_construction_under_init_keeps_each_rank_below_half_the_model() -> None:
    full = LAYERS * WIDTH * WIDTH * 4
    mib = 2**20
    results = run_distributed(_memory, 4, timeout=120)
    report = [{k: round(v / mib) if k != "loss" else v for k, v in r.items()} for r in results]
    for r in results:
        assert r["plain"] > 0.9 * full, report  # the measurement sees a whole model
        assert r["init"] < 0.5 * full, report  # pieces (1/4) + one layer at a time
        assert torch.isfinite(torch.tensor(r["loss"])), report
    print(f"full model {full / mib:.0f} MiB; peak RSS growth per rank (MiB): {report}")
