"""Pipeline-engine checkpoints: exact resume and loading onto other pipeline/data layouts.

The 8-layer model of ``test_pipe_engine`` with a tied embedding/head (first and last
stage), ZeRO-1, AdamW, gradient clipping. Layers are saved under their global names
(``3.fc.weight``, ``tied_modules.embed.weight``); the tied copy is written once, by the
stage that owns it. Every layout trains the same global batch of 4 micro-batches per step.

* exact resume at pp=2 x dp=1: 4 straight steps == 2 steps + save + fresh engine (other
  layer seeds) + load + 2 steps, bitwise in losses and parameters;
* resharding: pp=4 -> pp=1 x dp=2 and pp=2 -> pp=2 x dp=2; the continued training matches
  the one-process reference (fp32, 1e-5 relative);
* ``get_fp32_state_dict_from_checkpoint`` of a pipeline checkpoint has every layer.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from test_pipe_engine import PipeSpec, micro_batch, reference_run

from shardspeed.checkpoint import get_fp32_state_dict_from_checkpoint
from shardspeed.testing import assert_close_rel, run_distributed

GLOBAL_MICRO = 4  # micro-batches per step in every layout (dp * m)
TIED = "tied_modules.embed.weight"


def _spec(pp: int, dp: int, steps: int = 4) -> PipeSpec:
    return PipeSpec(pp=pp, dp=dp, m=GLOBAL_MICRO // dp, tied=True, steps=steps)


def _engine(spec: PipeSpec, base_seed: int = 1234):
    import shardspeed
    from shardspeed.pipe import PipeDataParallelTopology, PipelineModule

    net = PipelineModule(
        spec.layers(),
        topology=PipeDataParallelTopology(num_pp=spec.pp, num_dp=spec.dp),
        loss_fn=spec.loss_fn(),
        seed_layers=True,
        base_seed=base_seed,
        partition_method="uniform",
    )
    engine, _, _, _ = shardspeed.initialize(model=net, config=spec.config())
    return engine


def _train(engine, spec: PipeSpec, steps: range) -> list[float]:
    d = engine.dp_rank

    def data():
        for step in steps:
            for k in range(spec.m):
                yield micro_batch(spec, step, k * spec.dp + d)

    it = data()
    return [float(engine.train_batch(it)) for _ in steps]


def _params(engine) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def _job(job: dict[str, Any]) -> Any:
    spec = job["spec"]
    if job["op"] == "straight":
        engine = _engine(spec)
        out: Any = (_train(engine, spec, range(4)), _params(engine))
    elif job["op"] == "save":
        engine = _engine(spec)
        losses = _train(engine, spec, range(2))
        engine.save_checkpoint(job["dir"])
        out = losses
    else:  # load into a differently seeded engine, train 2 more steps
        engine = _engine(spec, base_seed=4321)
        path, _ = engine.load_checkpoint(job["dir"])
        assert path is not None and path.endswith("global_step2"), path
        assert engine.global_steps == 2
        out = (_train(engine, spec, range(2, 4)), _params(engine))
    engine.destroy()
    return out


def _jobs(jobs: list[dict[str, Any]]) -> list[Any]:
    return [_job(j) for j in jobs]


def test_pipeline_checkpoint_resume_and_reshard(tmp_path: Path) -> None:
    p2, p4 = str(tmp_path / "pp2"), str(tmp_path / "pp4")
    save_p4 = {"op": "save", "spec": _spec(4, 1), "dir": p4}
    straight = {"op": "straight", "spec": _spec(2, 1)}
    save_p2 = {"op": "save", "spec": _spec(2, 1), "dir": p2}
    resume = {"op": "load", "spec": _spec(2, 1), "dir": p2}
    p4_to_dp2 = {"op": "load", "spec": _spec(1, 2), "dir": p4}
    p2_to_pp2dp2 = {"op": "load", "spec": _spec(2, 2), "dir": p2}
    calls = [(4, [save_p4]), (2, [straight, save_p2, resume, p4_to_dp2]), (4, [p2_to_pp2dp2])]
    results: dict[int, list[Any]] = {}
    for world, jobs in calls:
        per_rank = run_distributed(_jobs, world, jobs, timeout=300)
        for i, job in enumerate(jobs):
            results[id(job)] = [rank_results[i] for rank_results in per_rank]

    # exact resume at the same layout: bitwise
    for rank in range(2):
        straight_losses, straight_params = results[id(straight)][rank]
        first = results[id(save_p2)][rank]
        rest, resumed_params = results[id(resume)][rank]
        assert first + rest == straight_losses, (rank, first + rest, straight_losses)
        assert set(resumed_params) == set(straight_params)
        for name, value in straight_params.items():
            assert torch.equal(value, resumed_params[name]), f"rank {rank}: {name}"

    # other layouts continue like the one-process reference
    ref_losses, ref_params = reference_run(_spec(2, 1))
    for label, save, load in (
        ("pp4 -> pp1 x dp2", save_p4, p4_to_dp2),
        ("pp2 -> pp2 x dp2", save_p2, p2_to_pp2dp2),
    ):
        seen: set[str] = set()
        for rank, (losses, params) in enumerate(results[id(load)]):
            saved = results[id(save)][0]
            assert_close_rel(saved + losses, ref_losses, rtol=1e-5, msg=f"{label} rank {rank}")
            for name, value in params.items():
                assert_close_rel(
                    value, ref_params[name], rtol=1e-5, atol=1e-7, msg=f"{label} rank {rank} {name}"
                )
                seen.add(name)
        assert seen == set(ref_params), f"{label}: missing {set(ref_params) - seen}"

    # the tied weight is written by its owner (stage 0) only, not by the last stage
    for ckpt, last in ((p2, 1), (p4, 3)):
        tag_dir = Path(ckpt) / "global_step2"
        owner_entries = json.loads((tag_dir / "rank00000.json").read_text())["tensors"]
        last_entries = json.loads((tag_dir / f"rank0000{last}.json").read_text())["tensors"]
        assert any(e["name"] == TIED for e in owner_entries)
        assert not any(e["name"] == TIED for e in last_entries), ckpt

    # consolidation sees every stage's layers; the tied weight once
    state = get_fp32_state_dict_from_checkpoint(p2)
    _, ref_at_save = reference_run(replace(_spec(2, 1), steps=2))
    assert set(state) == set(ref_at_save)
    for name, value in ref_at_save.items():
        assert_close_rel(state[name], value, rtol=1e-5, atol=1e-7, msg=f"consolidated {name}")


def _export(spec: PipeSpec, root: str) -> list[str]:
    engine = _engine(spec)
    _train(engine, spec, range(2))
    engine.save_checkpoint(f"{root}/ckpt", tag="t")
    assert engine.save_16bit_model(f"{root}/export") is True
    keys = list(engine.module.state_dict())
    engine.destroy()
    # the file loads back: each stage takes its own layers (and ties) from it
    fresh = _engine(spec, base_seed=4321)
    fresh.load_state_dict(torch.load(f"{root}/export/pytorch_model.bin", weights_only=True))
    assert fresh.save_16bit_model(f"{root}/reexport") is True
    fresh.destroy()
    return keys


def test_save_16bit_model_writes_every_stage(tmp_path: Path) -> None:
    """pp 2 x dp 2: rank 0 holds stage 0's layers only; the export holds every stage's
    (the tied embedding once), equal to the checkpoint's consolidated weights (fp32), and
    ``engine.load_state_dict`` of it into a fresh (other seeds) engine restores every stage
    (re-exported: equal)."""
    per_rank = run_distributed(_export, 4, _spec(2, 2), str(tmp_path), timeout=300)
    written = torch.load(tmp_path / "export" / "pytorch_model.bin", weights_only=True)
    consolidated = get_fp32_state_dict_from_checkpoint(tmp_path / "ckpt", tag="t")
    stage_keys = {k for keys in per_rank for k in keys}
    assert set(per_rank[0]) < stage_keys  # rank 0 alone would miss the last stage's layers
    assert set(written) == stage_keys == set(consolidated)
    assert list(written).count(TIED) == 1
    for name, value in consolidated.items():
        assert torch.equal(written[name], value), name
    reloaded = torch.load(tmp_path / "reexport" / "pytorch_model.bin", weights_only=True)
    assert list(reloaded) == list(written)
    for name, value in written.items():
        assert torch.equal(reloaded[name], value), f"load_state_dict: {name}"
