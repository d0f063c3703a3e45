"""ZeRO stages 0-2 x {fp32, bf16, fp16} x GAS {1, 3} x world {2, 4} match a one-process reference.

The reference (``parity_common.reference_run``) trains the same model on the same global
batch in one process, applying the same precision policy without any sharding.

Stated tolerances:

* fp32 (AdamW): 1e-5 relative (+1e-6 absolute) on every step's loss and every parameter.
* bf16 / fp16 with the default 16-bit gradient reduction: the engine rounds reduced
  gradients to the parameter dtype (relative error eps = 2**-8 bf16, 2**-11 fp16) where
  the reference sums in fp32, so each update may differ by lr * eps * |g|. Checked with
  SGD + momentum, where that difference stays proportional:
  rtol = 2 * eps (stored values round to nearest), atol = lr * steps * eps.
  (Adam would turn such differences on near-zero gradients into full +-lr steps, which
  says nothing about sharding; Adam in 16-bit is checked below with an fp32 reduction.)
* bf16 + AdamW with fp32 reduction and fp32 gradient storage on 2 ranks: the only
  difference left is the order of a two-term fp32 sum, which is commutative, so the
  result must agree to 2 * eps.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from parity_common import ParitySpec, engine_run, reference_run

from shardspeed.testing import run_distributed

EPS = {"bf16": 2.0**-8, "fp16": 2.0**-11}


def tolerance(spec: ParitySpec) -> dict[str, float]:
    if spec.precision == "fp32":
        return {"rtol": 1e-5, "atol": 1e-6}
    eps = EPS[spec.precision]
    return {"rtol": 2 * eps, "atol": spec.lr * spec.steps * eps}


def specs_for(world: int, precision: str) -> list[ParitySpec]:
    specs = []
    for stage, gas in itertools.product((0, 1, 2), (1, 3)):
        spec = ParitySpec(stage=stage, precision=precision, gas=gas, world=world)
        if precision != "fp32":
            spec.optimizer, spec.lr = "SGD", 0.1
        if gas == 3:
            spec.clip = 0.05  # active: the global norm is well above this
            spec.bucket_size = 3000  # several buckets
        if stage == 0 and gas == 1:
            spec.scheduler = {
                "type": "WarmupLR",
                "params": {"warmup_min_lr": 0.0, "warmup_max_lr": spec.lr, "warmup_num_steps": 3},
            }
        if stage == 1 and gas == 3 and precision == "fp32":
            spec.two_groups = True  # client optimizer with two param groups
        if stage == 2 and gas == 1:
            spec.scheduler = {
                "type": "WarmupDecayLR",
                "params": {"warmup_num_steps": 2, "total_num_steps": 6, "warmup_max_lr": spec.lr},
            }
        specs.append(spec)
    return specs


def _run_all(specs: list[ParitySpec]) -> list:
    return [engine_run(s) for s in specs]


def check_against_reference(specs: list[ParitySpec], per_rank: list) -> None:
    for i, spec in enumerate(specs):
        ref_losses, ref_params = reference_run(spec)
        tol = tolerance(spec)
        label = f"stage={spec.stage} gas={spec.gas} world={spec.world} {spec.precision}"
        for rank, results in enumerate(per_rank):
            losses, params = results[i]
            torch.testing.assert_close(
                torch.tensor(losses),
                torch.tensor(ref_losses),
                **tol,
                msg=lambda m, label=label, rank=rank: f"{label} rank {rank} losses: {m}",
            )
            for name, ref in ref_params.items():
                torch.testing.assert_close(
                    params[name],
                    ref,
                    **tol,
                    msg=lambda m, label=label, name=name: f"{label} param {name}: {m}",
                )


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("world", [2, 4])
def test_zero_stage_parity(world: int, precision: str) -> None:
    specs = specs_for(world, precision)
    check_against_reference(specs, run_distributed(_run_all, world, specs, timeout=300))


def test_bf16_adam_with_fp32_reduction_is_exact_on_two_ranks() -> None:
    exact = {"communication_data_type": "fp32", "data_types": {"grad_accum_dtype": "fp32"}}
    specs = [
        ParitySpec(stage=stage, precision="bf16", gas=gas, world=2, clip=0.05, extra=exact)
        for stage, gas in itertools.product((0, 1, 2), (1, 3))
    ]
    check_against_reference(specs, run_distributed(_run_all, 2, specs, timeout=300))
