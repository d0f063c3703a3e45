"""ZeRO stage-3 checkpoints: exact resume, resharding to/from stages 0-3, 16-bit export.

Stage-3 engines use a persistence threshold of 20 elements, so the tiny GPT has both
sharded unit flats (matrices) and a persistent flat (LayerNorm weights). Parameters are
read through ``engine.state_dict()``, which gathers them at stage 3.

* exact resume (world 2, fp32, no dropout): 6 straight steps == 4 steps + save + brand-new
  engine (other init seed) + load + 2 steps, bitwise in losses and parameters;
* resharding with stage-3 sources at worlds 1, 2 and 4 and stage-3 targets from four
  sources: w1s3 -> w4s1, w2s3; w2s3 -> w2s1, w4s3, w1s2; w4s3 -> w2s0, w1s3; w4s2 -> w2s3
  (``wXsY``: world X, stage Y); with CPU optimizer offload (``o``): w2s3o -> w1s2 and
  w4s2 -> w2s3o. The global batch is the same 4 micro-batches in every layout, so the
  continued training matches the one-process reference (fp32, 1e-5 relative), and
  re-saving right after the load reproduces every saved master and optimizer-state tensor
  exactly;
* ``save_16bit_model``: full weights on rank 0 with
  ``stage3_gather_16bit_weights_on_model_save``; False and no file without it.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
from parity_common import ParitySpec, make_model, reference_run, train_steps
from test_checkpoint_engine import _all_kinds

from shardspeed.checkpoint import load_checkpoint, save_16bit_model, save_checkpoint
from shardspeed.testing import run_distributed

SCHED = {
    "type": "WarmupLR",
    "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 4},
}


def _spec(world: int, stage: int, steps: int = 6) -> ParitySpec:
    return ParitySpec(
        stage=stage, world=world, gas=4 // world, steps=steps, bucket_size=1500, scheduler=SCHED
    )


def _new_engine(
    spec: ParitySpec, seed: int | None = None, gather16: bool = False, offload: bool = False
):
    import shardspeed

    model = make_model(replace(spec, seed=seed) if seed is not None else spec)
    cfg = spec.config()
    if spec.stage == 3:
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 20
        cfg["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = gather16
    if offload:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    engine, _, _, _ = shardspeed.initialize(model=model, config=cfg)
    return engine


def _params(engine) -> dict[str, torch.Tensor]:
    """Full parameters by (deduplicated) name; a collective at stage 3."""
    state = engine.state_dict()
    return {n: state[n].detach().clone() for n, _ in engine.module.named_parameters()}


def _resume_and_export(tmp: str) -> dict:
    from shardspeed import comm

    spec = _spec(2, 3)
    engine = _new_engine(spec, gather16=True)
    assert engine.sharding.persistent_flats and any(u.flats for u in engine.sharding.units[1:])
    straight = train_steps(engine, spec, range(6))
    final = _params(engine)
    assert save_16bit_model(engine, Path(tmp) / "w16", "model.safetensors") is True
    engine.destroy()

    engine = _new_engine(spec)
    first = train_steps(engine, spec, range(4))
    save_checkpoint(engine, Path(tmp) / "resume")
    engine.destroy()
    engine = _new_engine(spec, seed=77)  # different init: everything must come from the load
    path, _ = load_checkpoint(engine, Path(tmp) / "resume")
    assert path is not None and engine.global_steps == 4
    rest = train_steps(engine, spec, range(4, 6))
    resumed = _params(engine)
    off = Path(tmp) / f"off_{comm.get_rank()}"
    assert save_16bit_model(engine, off) is False  # flag false at stage 3
    assert not off.exists()
    engine.destroy()
    return {"straight": straight, "resumed": first + rest, "final": final, "after": resumed}


def _reshard_rank(jobs: list[dict]) -> list:
    out = []
    for job in jobs:
        spec = job["spec"]
        if job["op"] == "resume":
            out.append(_resume_and_export(job["dir"]))
            continue
        if job["op"] == "save":
            engine = _new_engine(spec, offload=job.get("offload", False))
            losses = train_steps(engine, spec, range(3))
            save_checkpoint(engine, job["dir"])
            out.append(losses)
        else:
            engine = _new_engine(spec, seed=99, offload=job.get("offload", False))
            load_checkpoint(engine, job["src"])
            assert engine.global_steps == 3
            save_checkpoint(engine, job["resave"])  # must reproduce the saved tensors
            losses = train_steps(engine, spec, range(3, 6))
            out.append((losses, _params(engine)))
        engine.destroy()
    return out


def test_zero3_resume_reshard_and_16bit_export(tmp_path: Path) -> None:
    d = {k: str(tmp_path / k) for k in ("w1s3", "w2s3", "w2s3o", "w4s2", "w4s3", "resume")}
    saves = {  # a trailing "o": CPU optimizer offload
        n: {"op": "save", "spec": _spec(int(n[1]), int(n[3])), "dir": d[n], "offload": "o" in n}
        for n in ("w1s3", "w2s3", "w2s3o", "w4s2", "w4s3")
    }
    resume = {"op": "resume", "spec": _spec(2, 3), "dir": d["resume"]}

    def load(src: str, world: int, stage: int, offload: str = "") -> tuple[str, dict]:
        label = f"{src}->w{world}s{stage}{offload}"
        job = {"op": "load", "spec": _spec(world, stage), "src": d[src], "offload": bool(offload)}
        return label, {**job, "resave": str(tmp_path / label)}

    loads = dict(
        load(*args)
        for args in (
            ("w1s3", 4, 1), ("w2s3", 2, 1), ("w4s2", 2, 3), ("w4s3", 2, 0), ("w1s3", 2, 3),
            ("w2s3", 4, 3), ("w4s3", 1, 3), ("w2s3", 1, 2), ("w4s2", 2, 3, "o"), ("w2s3o", 1, 2),
        )
    )  # fmt: skip
    calls = [
        (1, [saves["w1s3"]]),
        (4, [saves["w4s2"], saves["w4s3"], loads["w1s3->w4s1"]]),
        (2, [resume, saves["w2s3"], saves["w2s3o"], *(loads[k] for k in loads if "->w2" in k)]),
        (4, [loads["w2s3->w4s3"]]),
        (1, [loads[k] for k in loads if "->w1" in k]),
    ]
    results: dict[int, object] = {}
    for world, jobs in calls:
        per_rank = run_distributed(_reshard_rank, world, jobs, timeout=300)
        for job, res in zip(jobs, per_rank[0]):
            results[id(job)] = res

    # exact resume, bitwise
    r = results[id(resume)]
    assert r["straight"] == r["resumed"], (r["straight"], r["resumed"])
    for name, p in r["final"].items():
        assert torch.equal(p, r["after"][name]), f"resume: {name} differs"

    # resharding against the one-process reference
    ref_losses, ref_params = reference_run(_spec(2, 0))
    tol = {"rtol": 1e-5, "atol": 1e-6}
    for label, job in loads.items():
        src = label.split("->")[0]
        losses, params = results[id(job)]
        torch.testing.assert_close(
            torch.tensor(results[id(saves[src])] + losses), torch.tensor(ref_losses), **tol,
            msg=label,
        )  # fmt: skip
        for name, ref in ref_params.items():
            torch.testing.assert_close(params[name], ref, **tol, msg=f"{label}: {name}")
        before, after = _all_kinds(Path(d[src])), _all_kinds(Path(job["resave"]))
        assert set(before) == set(after) and ("h.0.attn.c_attn.weight", "exp_avg") in before
        for key, tensor in before.items():
            assert torch.equal(tensor, after[key]), f"{label}: {key} changed by save/load"

    # 16-bit export at stage 3 (fp32 run): full weights, tied head under both names
    from safetensors.torch import load_file

    state = load_file(str(tmp_path / "resume" / "w16" / "model.safetensors"))
    assert {"wte.weight", "lm_head.weight"} <= set(state)
    model = make_model(_spec(2, 3))
    model.load_state_dict(state, strict=True)
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), r["final"][name]), f"16-bit export: {name}"
    assert not list((tmp_path / "resume").glob("off_*"))
