"""Engine checkpoints: exact resume, resharding across world sizes/stages, kill safety, export.

Exact resume (world 2, stages 0-2, fp32 and bf16, dropout on, engine dataloader with
shuffling and a WarmupLR schedule): 10 straight steps == 4 steps + save + brand-new engine
(different init seed) + load + 6 steps, bitwise in losses and parameters.

Resharding: checkpoints saved at world {1, 2, 4} x stage {0, 1, 2} load at other
worlds/stages (1->2, 1->4, 2->4, 4->2, 2->1, 4->1; every stage as source and target). The
global batch is the same 4 micro-batches in every layout (world * GAS = 4), so training
continued after the load must match the one-process reference run of 6 steps (fp32, 1e-5
relative); re-saving right after the load must reproduce the saved masters and optimizer
state exactly.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from parity_common import ParitySpec, make_model, reference_run, train_steps

from shardspeed.checkpoint import (
    get_fp32_state_dict_from_checkpoint,
    load_checkpoint,
    save_16bit_model,
    save_checkpoint,
)
from shardspeed.checkpoint.format import load_manifest, resolve_tag
from shardspeed.checkpoint.shards import SliceReader
from shardspeed.models import GPT, GPTConfig
from shardspeed.testing import run_distributed

# -- exact resume ----------------------------------------------------------------------------


def _resume_config(stage: int, precision: str) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 2000},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 5},
        },
    }
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def _dropout_engine(stage: int, precision: str, seed: int):
    import shardspeed

    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16, dropout=0.1))
    g = torch.Generator().manual_seed(5)
    data = torch.utils.data.TensorDataset(torch.randint(0, 32, (24, 9), generator=g))
    engine, _, loader, _ = shardspeed.initialize(
        model=model, config=_resume_config(stage, precision), training_data=data
    )
    # Exact resume is opt-in (DeepSpeed restores no dataloader position and its iterators
    # draw from the global RNG): own generator, position restored by load_checkpoint.
    loader.exact_resume = True
    loader.loader.generator = torch.Generator()
    return engine, loader


def _train(engine, batches, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        (tokens,) = next(batches)
        _, loss = engine(tokens[:, :-1], tokens[:, 1:])
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    return losses


def _forever(loader):
    while True:
        yield from loader


def _params(engine) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def _resume_rank(tmp: str) -> list:
    from shardspeed import comm

    out = []
    for stage in (0, 1, 2):
        for precision in ("fp32", "bf16"):
            torch.manual_seed(100 + comm.get_rank())
            engine, loader = _dropout_engine(stage, precision, seed=1)
            straight = _train(engine, _forever(loader), 10)
            final = _params(engine)
            d16 = Path(tmp) / f"16bit_s{stage}_{precision}"
            save_16bit_model(engine, d16, "model.safetensors")
            save_16bit_model(engine, d16)
            engine.destroy()

            torch.manual_seed(100 + comm.get_rank())
            engine, loader = _dropout_engine(stage, precision, seed=1)
            first = _train(engine, _forever(loader), 4)
            ckpt = Path(tmp) / f"resume_s{stage}_{precision}"
            save_checkpoint(engine, ckpt, client_state={"note": "hi", "t": torch.arange(3)})
            engine.destroy()
            engine, loader = _dropout_engine(stage, precision, seed=77)  # different init
            torch.manual_seed(4242)  # RNG must come from the checkpoint
            path, client = load_checkpoint(engine, ckpt, restore_rng=True)
            assert path is not None and path.endswith("global_step4"), path
            assert client["note"] == "hi" and torch.equal(client["t"], torch.arange(3))
            assert engine.global_steps == 4 and loader.position == 4
            rest = _train(engine, _forever(loader), 6)
            out.append((stage, precision, straight, first + rest, final, _params(engine)))
            engine.destroy()
    return out


def test_exact_resume_and_16bit_export(tmp_path: Path) -> None:
    per_rank = run_distributed(_resume_rank, 2, str(tmp_path), timeout=300)
    for rank, results in enumerate(per_rank):
        for stage, precision, straight, resumed, final, final_resumed in results:
            label = f"rank {rank} stage {stage} {precision}"
            assert straight == resumed, f"{label}: losses {straight} != {resumed}"
            for name, p in final.items():
                assert torch.equal(p, final_resumed[name]), f"{label}: {name} differs"
    from safetensors.torch import load_file

    for stage, precision, _, _, final, _ in per_rank[0]:
        d16 = tmp_path / f"16bit_s{stage}_{precision}"
        st = load_file(str(d16 / "model.safetensors"))
        bin_ = torch.load(d16 / "pytorch_model.bin", weights_only=True)
        assert "lm_head.weight" in st and "wte.weight" in st
        for name, p in final.items():
            assert st[name].dtype == p.dtype and torch.equal(st[name], p), name
            assert torch.equal(bin_[name], p), name


# -- resharding ------------------------------------------------------------------------------

SCHED = {
    "type": "WarmupLR",
    "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 4},
}


def _spec(world: int, stage: int, steps: int = 3) -> ParitySpec:
    return ParitySpec(
        stage=stage, world=world, gas=4 // world, steps=steps, bucket_size=1500, scheduler=SCHED
    )


def _new_engine(spec: ParitySpec, seed: int | None = None):
    import shardspeed

    model = make_model(replace(spec, seed=seed) if seed is not None else spec)
    engine, _, _, _ = shardspeed.initialize(model=model, config=spec.config())
    return engine


def _reshard_rank(jobs: list[dict]) -> list:
    out = []
    for job in jobs:
        spec = job["spec"]
        if job["op"] == "save":
            engine = _new_engine(spec)
            losses = train_steps(engine, spec, range(3))
            save_checkpoint(engine, job["dir"])
            out.append(losses)
        elif job["op"] == "load":
            engine = _new_engine(spec, seed=99)
            load_checkpoint(engine, job["src"])
            assert engine.global_steps == 3
            save_checkpoint(engine, job["resave"])
            losses = train_steps(engine, spec, range(3, 6))
            out.append((losses, _params(engine)))
        else:  # kill: a save that dies midway must leave the previous tag loadable
            engine = _new_engine(spec)
            train_steps(engine, spec, range(2))
            save_checkpoint(engine, job["dir"], tag="good")
            good = _params(engine)
            train_steps(engine, spec, range(2, 3))
            os.environ["SHARDSPEED_CKPT_FAULT"] = "after_rank_files"
            try:
                with pytest.raises(RuntimeError, match="simulated crash"):
                    save_checkpoint(engine, job["dir"], tag="bad")
            finally:
                del os.environ["SHARDSPEED_CKPT_FAULT"]
            engine.destroy()
            fresh = _new_engine(spec, seed=5)
            path, _ = load_checkpoint(fresh, job["dir"])
            assert path is not None and path.endswith("good"), path
            assert all(torch.equal(p, good[n]) for n, p in _params(fresh).items())
            fresh.destroy()
            fresh = _new_engine(replace(spec, stage=2), seed=6)  # weights only
            load_checkpoint(fresh, job["dir"], load_module_only=True)
            assert all(torch.equal(p, good[n]) for n, p in _params(fresh).items())
            assert fresh.global_steps == 0 and len(fresh.basic_optimizer.state) == 0
            out.append(path)
        engine.destroy()
    return out


def _all_kinds(ckpt: Path) -> dict[tuple[str, str], torch.Tensor]:
    tag_dir = ckpt / str(resolve_tag(ckpt, None))
    manifest = load_manifest(tag_dir)
    reader = SliceReader(tag_dir)
    return {
        (name, kind): reader.full(entry, kind, name)
        for name, entry in manifest["index"].items()
        for kind in entry["kinds"]
    }


def test_reshard_matrix_kill_and_consolidation(tmp_path: Path) -> None:
    d = {k: str(tmp_path / k) for k in ("w1s0", "w1s2", "w2s0", "w2s2", "w4s1", "kill")}
    loads = [  # (source, target world, target stage)
        ("w1s0", 2, 1), ("w1s2", 4, 0), ("w2s0", 4, 2), ("w4s1", 2, 2), ("w2s2", 1, 1),
        ("w4s1", 1, 0), ("w1s2", 2, 0),
    ]  # fmt: skip

    def load_jobs(world: int, src_worlds: str = "124") -> list[dict]:
        return [
            {
                "op": "load",
                "src": d[src],
                "spec": _spec(world, stage, 6),
                "resave": f"{d[src]}->{world}s{stage}",
            }
            for src, w, stage in loads
            if w == world and src[1] in src_worlds
        ]

    def saves(*names: str) -> list[dict]:
        return [{"op": "save", "spec": _spec(int(n[1]), int(n[3])), "dir": d[n]} for n in names]

    results: dict[str, object] = {}
    calls = [
        (1, saves("w1s0", "w1s2")),
        (2, load_jobs(2, "1") + saves("w2s0", "w2s2") + [{"op": "kill", "spec": _spec(2, 1), "dir": d["kill"]}]),
        (4, load_jobs(4) + saves("w4s1")),
        (2, load_jobs(2, "4")),
        (1, load_jobs(1)),
    ]  # fmt: skip
    for world, jobs in calls:
        per_rank = run_distributed(_reshard_rank, world, jobs, timeout=300)
        for job, res in zip(jobs, per_rank[0]):
            results[job.get("resave") or job["dir"]] = (job, res)

    ref_losses, ref_params = reference_run(_spec(2, 0, 6))  # same math in every layout
    tol = {"rtol": 1e-5, "atol": 1e-6}
    for src, world, stage in loads:
        resave = f"{d[src]}->{world}s{stage}"
        _, (losses, params) = results[resave]
        _, saved_losses = results[d[src]]
        label = f"{src} -> world {world} stage {stage}"
        torch.testing.assert_close(
            torch.tensor(saved_losses + losses), torch.tensor(ref_losses), **tol, msg=label
        )
        for name, ref in ref_params.items():
            torch.testing.assert_close(params[name], ref, **tol, msg=f"{label}: {name}")
        before, after = _all_kinds(Path(d[src])), _all_kinds(Path(resave))
        assert set(before) == set(after) and ("h.0.attn.c_attn.weight", "exp_avg") in before
        for key, tensor in before.items():
            assert torch.equal(tensor, after[key]), f"{label}: {key} changed by save/load"
    assert results[d["kill"]][1].endswith("good")
    assert (Path(d["kill"]) / "latest").read_text() == "good"
    assert any(".tmp-" in p.name for p in Path(d["kill"]).iterdir())

    # consolidation: loads strictly into a fresh model (tied weight under both names)
    state = get_fp32_state_dict_from_checkpoint(d["w1s2"])
    assert {"wte.weight", "lm_head.weight"} <= set(state)
    model = make_model(_spec(1, 2))
    model.load_state_dict(state, strict=True)
    masters = _all_kinds(Path(d["w1s2"]))
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), masters[(name, "master")]), name
    _check_cli(
        Path(d["w4s1"]), tmp_path / "hf", state_like=get_fp32_state_dict_from_checkpoint(d["w4s1"])
    )


def _check_cli(ckpt: Path, out: Path, state_like: dict[str, torch.Tensor]) -> None:
    import json

    from safetensors.torch import load_file

    from shardspeed.launcher.checkpoint_cmd import main

    assert main(["to-fp32", str(ckpt), str(out), "--safetensors", "--max-shard-size", "8KB"]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted({*index["weight_map"].values()})
    assert len(files) > 2 and files[0].startswith("model-00001-of-")
    merged = {}
    for f in files:
        part = load_file(str(out / f))
        assert sum(t.numel() * 4 for t in part.values()) <= 8000 or len(part) == 1
        merged.update(part)
    assert set(merged) == set(state_like) == set(index["weight_map"])
    for k, v in state_like.items():
        assert torch.equal(merged[k], v), k
    assert main(["to-fp32", str(ckpt), str(out / "bin")]) == 0
    single = torch.load(out / "bin" / "pytorch_model.bin", weights_only=True)
    assert set(single) == set(state_like)
    assert main(["to-fp32", str(out / "nothing"), str(out / "x")]) == 2
