"""ZeRO stage 3 (+ CPU optimizer offload) matches the one-process reference.

Same tolerances as ``test_zero_parity.py``: fp32 AdamW 1e-5 relative; bf16 with SGD +
momentum rtol = 2 * eps, atol = lr * steps * eps. The parity GPT ties wte/lm_head.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from parity_common import ParitySpec, make_model, param_groups, train_steps
from test_zero_parity import check_against_reference

from shardspeed.testing import run_distributed


def zero3_spec(world: int, precision: str, gas: int, **zero: object) -> ParitySpec:
    zc = {"stage": 3, "stage3_param_persistence_threshold": 0, **zero}
    spec = ParitySpec(stage=3, precision=precision, gas=gas, world=world, extra={})
    spec.extra["zero_optimization"] = zc
    if precision != "fp32":
        spec.optimizer, spec.lr = "SGD", 0.1
    if gas == 3:
        spec.clip = 0.05
    return spec


def zero3_run(spec: ParitySpec) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Like ``parity_common.engine_run``, but reads the final params through GatheredParameters."""
    import shardspeed
    from shardspeed.zero import GatheredParameters

    model, optimizer = make_model(spec), None
    if spec.two_groups:
        from shardspeed.optim import build_optimizer

        optimizer = build_optimizer("AdamW", {"lr": spec.lr}, param_groups(model, spec))
    engine, _, _, _ = shardspeed.initialize(model=model, optimizer=optimizer, config=spec.config())
    if "offload_optimizer" in spec.extra["zero_optimization"]:  # separate host copies
        flats = [f for g in engine.flat_groups for f in g.flats]
        masters = [(f.masters[0], f.residency.resident) for f in flats]
        assert all(m is not s and m.device.type == "cpu" for m, s in masters)
        assert all(f.host_grads for f in flats)
    losses = train_steps(engine, spec, range(spec.steps))
    params = list(engine.module.parameters())
    assert all(p.numel() == 0 for p in params if not getattr(p, "ds_persist", True))
    with GatheredParameters(params):
        final = {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
    engine.destroy()
    return losses, final


def _run_all(specs: list[ParitySpec]) -> list:
    return [zero3_run(s) for s in specs]


def specs_for(world: int) -> list[ParitySpec]:
    specs = [
        zero3_spec(world, precision, gas)
        for precision, gas in itertools.product(("fp32", "bf16"), (1, 3))
    ]
    # optimizer state and step on the host
    specs.append(zero3_spec(world, "bf16", 3, offload_optimizer={"device": "cpu"}))
    if world == 2:  # the rest once: they do not depend on the world size
        # small params (LayerNorm weights, 16 elements) stay unsharded
        specs.append(zero3_spec(world, "fp32", 3, stage3_param_persistence_threshold=100))
        specs.append(zero3_spec(world, "fp32", 1, offload_optimizer={"device": "cpu"}))
        specs.append(zero3_spec(world, "fp16", 3))
        # bf16 + AdamW with fp32 reduction and gradient shards: agrees to 2 * eps
        exact = zero3_spec(world, "bf16", 3)
        exact.optimizer, exact.lr = "AdamW", 1e-2
        exact.extra.update(communication_data_type="fp32", data_types={"grad_accum_dtype": "fp32"})
        specs.append(exact)
        # client optimizer with decay / no-decay groups: two flats per unit
        two = zero3_spec(world, "fp32", 3)
        two.two_groups = True
        specs.append(two)
    return specs


@pytest.mark.parametrize("world", [2, 4])
def test_zero3_parity(world: int) -> None:
    specs = specs_for(world)
    check_against_reference(specs, run_distributed(_run_all, world, specs, timeout=300))
