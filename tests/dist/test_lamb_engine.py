"""LAMB on the engine's flat masters at ZeRO 0-3 matches LAMB on whole tensors in one process.

LAMB's trust ratio ``||p|| / ||u||`` is per parameter, but the engine steps flat buckets of
concatenated parameters, sharded over ranks at stages 1-3 (a parameter can straddle
buckets and ranks). The engine hands the optimizer each parameter's fragments
(``set_param_segments``); the per-parameter squared norms are summed over fragments and over
the shard axis before the ratio is taken. Reference: ``parity_common.reference_run`` with
the same ``Lamb`` on per-parameter fp32 masters in one process. fp32 tolerance as the
other parity tests (1e-5 relative, 1e-6 absolute), losses every step and final
parameters; small buckets (3000 elements) so parameters are split.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from parity_common import ParitySpec, reference_run, train_steps

from shardspeed.testing import assert_close_rel, run_distributed


def _spec(stage: int, gas: int) -> ParitySpec:
    return ParitySpec(stage=stage, gas=gas, optimizer="Lamb", lr=2e-2, clip=0.5, steps=4,
                      bucket_size=3000,
                      extra={"zero_optimization": {"stage": stage, "reduce_bucket_size": 3000,
                                                   "stage3_param_persistence_threshold": 0}})  # fmt: skip


def _run(specs: list[ParitySpec]) -> list[tuple[list[float], dict[str, torch.Tensor], Any]]:
    from parity_common import make_model

    import shardspeed
    from shardspeed.zero import GatheredParameters

    out = []
    for spec in specs:
        model = make_model(spec)
        engine, _, _, _ = shardspeed.initialize(model=model, config=spec.config())
        losses = train_steps(engine, spec, range(spec.steps))
        with GatheredParameters(list(model.parameters())):
            params = {n: p.detach().float().clone() for n, p in model.named_parameters()}
        out.append((losses, params, engine.optimizer.optimizer.get_lamb_coeffs()))
        engine.destroy()
    return out


@pytest.mark.parametrize("gas", [1, 2])
def test_lamb_matches_whole_tensor_lamb_at_every_stage(gas: int) -> None:
    specs = [_spec(stage, gas) for stage in (0, 1, 2, 3)]
    per_rank = run_distributed(_run, 2, specs, timeout=300)
    for i, spec in enumerate(specs):
        ref_losses, ref_params = reference_run(spec)
        for rank, results in enumerate(per_rank):
            losses, params, coeffs = results[i]
            label = f"stage {spec.stage} gas {gas} rank {rank}"
            assert_close_rel(losses, ref_losses, rtol=1e-5, atol=1e-6, msg=f"{label} losses")
            for name, ref in ref_params.items():
                assert_close_rel(params[name], ref, rtol=1e-5, atol=1e-6, msg=f"{label} {name}")
            # one trust ratio per parameter (named_parameters lists the tied weight once)
            assert len(coeffs) == len(ref_params), (len(coeffs), label)
