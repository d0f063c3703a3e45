"""Checkpoints with NVMe-offloaded state (stage 3, world 2, fp32 AdamW).

Masters and Adam state live in swap files between steps; the checkpoint code reads and
writes them through the optimizer's ``state_resident`` hook. Checked bitwise:

* 4 straight steps == 2 steps + save + a brand-new NVMe engine (other init seed) + load
  + 2 steps (losses and parameters): the load reached the swap files;
* the same checkpoint loaded into an engine without offload continues identically: the
  save wrote the real masters and optimizer state, not the swapped-out placeholders;
* ``engine.optimizer.state_dict()`` returns the real state tensors.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import torch
from parity_common import ParitySpec, make_model, train_steps

from shardspeed.testing import run_distributed

SPEC = ParitySpec(stage=3, world=2, gas=2, steps=4, clip=0.05)


def _engine(nvme_path: str | None, seed: int):
    import shardspeed

    cfg = SPEC.config()
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 20  # + a persistent flat
    if nvme_path is not None:
        nvme = {"device": "nvme", "nvme_path": nvme_path}
        cfg["zero_optimization"]["offload_optimizer"] = nvme
        cfg["zero_optimization"]["offload_param"] = {**nvme, "buffer_size": 4096}
    engine, _, _, _ = shardspeed.initialize(model=make_model(replace(SPEC, seed=seed)), config=cfg)
    return engine


def _train(engine, steps: range) -> list[float]:
    return train_steps(engine, SPEC, steps)


def _params(engine) -> dict[str, torch.Tensor]:
    state = engine.state_dict()
    return {n: state[n].detach().clone() for n, _ in engine.module.named_parameters()}


def _round_trip(nvme: str, ckpt: str) -> dict:
    # The NVMe engine steps with DeepSpeedCPUAdam and the plain one with torch's AdamW. The
    # native CPU Adam kernel rounds ~1 ulp differently from torch's (its parity is tested in
    # tests/unit/test_cpu_adam.py), so both use torch's fused kernel here and the
    # continuation stays bitwise comparable.
    previous = os.environ.get("SHARDSPEED_CPU_ADAM")
    os.environ["SHARDSPEED_CPU_ADAM"] = "torch"
    try:
        return _round_trip_torch_kernel(nvme, ckpt)
    finally:
        if previous is None:
            os.environ.pop("SHARDSPEED_CPU_ADAM")
        else:
            os.environ["SHARDSPEED_CPU_ADAM"] = previous


def _round_trip_torch_kernel(nvme: str, ckpt: str) -> dict:
    engine = _engine(nvme, SPEC.seed)
    straight = _train(engine, range(4))
    final = _params(engine)
    engine.destroy()

    engine = _engine(nvme, SPEC.seed)
    first = _train(engine, range(2))
    state = engine.optimizer.state_dict()["state"]
    assert state and all(
        s["exp_avg"].numel() > 0 and s["exp_avg"].abs().sum() > 0 for s in state.values()
    )
    engine.save_checkpoint(ckpt, tag="t")
    engine.destroy()

    out = {"straight": straight, "final": final}
    for name, path in (("nvme", nvme), ("plain", None)):
        engine = _engine(path, seed=77)  # different init: everything must come from the load
        loaded, _ = engine.load_checkpoint(ckpt, tag="t")
        assert loaded is not None
        out[name] = (first + _train(engine, range(2, 4)), _params(engine))
        engine.destroy()
    return out


def test_nvme_offload_checkpoint_round_trip(tmp_path: Path) -> None:
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    results = run_distributed(_round_trip, 2, str(nvme), str(tmp_path / "ckpt"), timeout=180)
    for res in results:
        for name in ("nvme", "plain"):
            losses, params = res[name]
            assert losses == res["straight"], (name, losses, res["straight"])
            for key, value in res["final"].items():
                assert torch.equal(params[key], value), (name, key)
    assert os.listdir(nvme) == []
