"""The hybrid engine (``hybrid_engine.enabled``): generation phases between training steps.

Each rank trains the parity GPT through ``shardspeed.initialize``; before every step it
switches to ``eval()``, generates greedily through ``engine.generate`` and the patched
``engine.module.generate``, and switches back to ``train()``. Checked on 2 gloo ranks:

* the training losses and final parameters are *identical* (bitwise) to the same run
  without generation: a generation phase leaves no trace in training state;
* the generated tokens equal those of a plain GPT holding the engine's full weights
  (recomputing without a KV cache);
* ZeRO-3 with ``pin_parameters`` gathers each flat once per generation phase and
  releases them after; ``pin_parameters: false`` gathers per unit and decoding step.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from shardspeed.testing import run_distributed
from tests.dist.parity_common import ParitySpec, make_model, train_steps

PROMPT = torch.tensor([[1, 2, 3], [7, 5, 9]])  # (B=2, T=3); block_size 8 fits 5 new tokens
NEW_TOKENS = 5


def _run(stage: int, generate: bool, pin: bool) -> dict[str, Any]:
    import shardspeed
    from shardspeed.models import GPT
    from shardspeed.zero import GatheredParameters
    from shardspeed.zero.flat_buffer import FlatGroup
    from shardspeed.zero.params import ZeroParamStatus

    spec = ParitySpec(stage=stage, steps=3, clip=1.0)
    spec.extra = {"hybrid_engine": {"enabled": True, "pin_parameters": pin}}
    if stage == 3:
        spec.extra["zero_optimization"] = {"stage": 3, "stage3_param_persistence_threshold": 0}
    model = make_model(spec)
    engine, _, _, _ = shardspeed.initialize(model=model, config=spec.config())

    launches = [0]
    original = FlatGroup.start_gather

    def counting(flat: FlatGroup) -> None:
        if flat.full is None and flat.residency._pending is None:  # noqa: SLF001 - a real launch
            launches[0] += 1
        original(flat)

    FlatGroup.start_gather = counting  # type: ignore[method-assign]
    losses, tokens, references, gathers, released = [], [], [], [], []
    try:
        for step in range(spec.steps):
            if generate:
                engine.eval()
                launches[0] = 0
                out = engine.generate(PROMPT, NEW_TOKENS, temperature=0.0)
                gathers.append(launches[0])
                again = engine.module.generate(PROMPT, NEW_TOKENS, temperature=0.0)
                assert torch.equal(out, again)
                tokens.append(out)
                if stage == 3:
                    flats = [f for u in engine.sharding.units for f in u.flats]
                    released.append(all(f.status is ZeroParamStatus.NOT_AVAILABLE for f in flats))
                plain = GPT(model.config)
                plain.load_state_dict(engine.state_dict())  # a collective at stage 3
                references.append(plain.eval().generate(PROMPT, NEW_TOKENS, 0.0, use_cache=False))
                engine.train()
            losses += train_steps(engine, spec, range(step, step + 1))
    finally:
        FlatGroup.start_gather = original  # type: ignore[method-assign]
    with GatheredParameters(list(model.parameters())):
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    num_flats = sum(len(u.flats) for u in engine.sharding.units) if stage == 3 else 0
    engine.destroy()
    assert "generate" not in model.__dict__  # destroy() gave the model its generate back
    return {"losses": losses, "params": params, "tokens": tokens, "refs": references,
            "gathers": gathers, "released": released, "num_flats": num_flats}  # fmt: skip


def _both(stage: int, pin: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    return _run(stage, True, pin), _run(stage, False, pin)


@pytest.mark.parametrize("stage", [2, 3])
def test_generation_phases_leave_training_unchanged(stage: int) -> None:
    for with_gen, without in run_distributed(_both, 2, stage, True, timeout=300):
        assert with_gen["losses"] == without["losses"]  # bitwise
        for name, value in without["params"].items():
            assert torch.equal(with_gen["params"][name], value), name
        for out, ref in zip(with_gen["tokens"], with_gen["refs"]):
            assert torch.equal(out, ref)
        if stage == 3:
            assert with_gen["released"] == [True] * 3
            # one gather per flat and phase (the root may already be resident)
            assert all(0 < g <= with_gen["num_flats"] for g in with_gen["gathers"])


def test_zero3_without_pinning_gathers_per_decoding_step() -> None:
    for with_gen, without in run_distributed(_both, 2, 3, False, timeout=300):
        assert with_gen["losses"] == without["losses"]
        for out, ref in zip(with_gen["tokens"], with_gen["refs"]):
            assert torch.equal(out, ref)
        assert all(g > NEW_TOKENS for g in with_gen["gathers"])  # units re-gathered every step


def test_hybrid_engine_needs_a_generate_method() -> None:
    run_distributed(_no_generate, 2, timeout=120)


def _no_generate() -> None:
    import shardspeed

    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    config = {"train_micro_batch_size_per_gpu": 1, "hybrid_engine": {"enabled": True},
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}  # fmt: skip
    with pytest.raises(ValueError, match="needs a model with a generate"):
        shardspeed.initialize(model=model, config=config)


@pytest.mark.slow  # suite time: the hybrid engine's parity tests above run in make test
def test_ppo_example_runs_on_two_ranks() -> None:
    import socket
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "examples" / "hybrid_ppo.py"
    with socket.socket() as s:  # a free rendezvous port: other jobs may hold 29500
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "shardspeed.launcher.cli", "--nproc", "2", "--master_port",
           str(port), str(script), "--iters", "2", "--new-tokens", "4", "--zero", "3"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "mean reward: first 5 iters" in done.stdout
