"""A compiled forward (``"compile": {"enabled": true}``) trains like eager at ZeRO 0-2.

``torch.compile`` of the model's forward keeps autograd's AccumulateGrad nodes eager, so the
reducer's post-accumulate-grad hooks still reduce gradient buckets while backward runs.
Checked on 2 gloo ranks with the tiny GPT: losses and final parameters at stages 0, 1, 2
(GAS 1; GAS 2 with active clipping at stage 2) equal the eager engine and the one-process
reference within fp32 tolerance. The default tier compiles with ``aot_eager`` (AOTAutograd's
forward and backward graphs, no code generation: a few seconds); the slow tier compiles
with Inductor (C++ code generation: about 45 s on a loaded 2-core CPU box).
"""

from __future__ import annotations

import pytest
import torch
from parity_common import ParitySpec, engine_run, reference_run

from shardspeed.testing import run_distributed

WORLD = 2
TOL = {"rtol": 1e-5, "atol": 1e-6}


def _specs(backend: str) -> list[ParitySpec]:
    block = {"compile": {"enabled": True, "backend": backend}}
    specs = [ParitySpec(stage=stage, world=WORLD, extra=dict(block)) for stage in (0, 1, 2)]
    specs.append(ParitySpec(stage=2, world=WORLD, gas=2, clip=0.05, extra=dict(block)))
    return specs


def _run(specs: list[ParitySpec]) -> list:
    """(compiled run, eager run, stayed compiled) per spec on this rank."""
    from torch._dynamo.utils import counters

    from shardspeed.runtime import compile_step

    states: list[compile_step.CompileState] = []
    compile_module = compile_step.compile_module

    def recording(*args, **kwargs):  # type: ignore[no-untyped-def]
        states.append(compile_module(*args, **kwargs))
        return states[-1]

    compile_step.compile_module = recording
    out = []
    try:
        for spec in specs:
            compiled = engine_run(spec)
            stayed = len(states) == 1 and states.pop().active  # built compiled, no fallback
            eager = engine_run(ParitySpec(**{**spec.__dict__, "extra": {}}))
            out.append((compiled, eager, stayed and counters["stats"]["unique_graphs"] > 0))
    finally:
        compile_step.compile_module = compile_module
    return out


def _check(specs: list[ParitySpec]) -> None:
    per_rank = run_distributed(_run, WORLD, specs, timeout=600)
    for i, spec in enumerate(specs):
        ref_losses, ref_params = reference_run(spec)
        for rank, results in enumerate(per_rank):
            (losses, params), (eager_losses, eager_params), compiled = results[i]
            where = f"stage={spec.stage} gas={spec.gas} rank {rank}"
            assert compiled, where
            for name, other in (("eager", eager_losses), ("reference", ref_losses)):
                torch.testing.assert_close(
                    torch.tensor(losses), torch.tensor(other), **TOL, msg=f"{where} vs {name}"
                )
            for pname, ref in ref_params.items():
                for name, other in (("eager", eager_params[pname]), ("reference", ref)):
                    msg = f"{where} param {pname} vs {name}"
                    torch.testing.assert_close(params[pname], other, **TOL, msg=msg)


def test_compiled_forward_matches_eager_aot_eager() -> None:
    _check(_specs("aot_eager"))


@pytest.mark.slow
def test_compiled_forward_matches_eager_inductor() -> None:
    _check(_specs("inductor"))
