"""Importing a real DeepSpeed 0.19 ZeRO-2/3 checkpoint and resuming it in ShardSpeed.

DeepSpeed (world 2, ZeRO-2 or ZeRO-3, fp32, torch AdamW, WarmupLR) trains the parity GPT for 3 steps
and saves; ``shardspeed checkpoint from-deepspeed`` converts the folder; a ShardSpeed
engine (world 2, ZeRO-1) loads it. Parameters and Adam moments equal DeepSpeed's
consolidated ones (1e-6) and 2 further steps give DeepSpeed's losses (1e-5).

Needs DeepSpeed, which CI does not install: run with the peers venv,
``.venv-peers/bin/python -m pytest tests/dist/test_checkpoint_deepspeed_import.py``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from parity_common import ParitySpec, make_model, micro_batch

from shardspeed.testing import run_distributed

SPEC = ParitySpec(stage=2, world=2)
SCHEDULER = {
    "type": "WarmupLR",
    "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 5},
}
SAVED_STEPS, MORE_STEPS = 3, 2


def _config(stage: int, torch_adam: bool) -> dict:
    params = {"lr": 1e-2, "weight_decay": 0.01}
    if torch_adam:
        params["torch_adam"] = True
    return {
        "train_micro_batch_size_per_gpu": SPEC.micro,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": params},
        "scheduler": SCHEDULER,
    }


def _train(engine, steps: range, rank: int) -> list[float]:
    losses = []
    for step in steps:
        x, y = micro_batch(SPEC, step, rank)
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _deepspeed_rank(save_dir: str, stage: int, result_dir: str) -> None:
    """One DeepSpeed rank (run under torch.distributed.run: DeepSpeed caches its process
    groups in module globals, so it cannot share the harness's reused worker processes)."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    model = make_model(SPEC)
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=_config(stage, torch_adam=True)
    )
    rank = torch.distributed.get_rank()
    _train(engine, range(SAVED_STEPS), rank)
    engine.save_checkpoint(save_dir)
    state = {}
    for name, p in model.named_parameters():
        state[name] = {
            "master": safe_get_full_fp32_param(p).clone(),
            "exp_avg": safe_get_full_optimizer_state(p, "exp_avg").clone(),
            "exp_avg_sq": safe_get_full_optimizer_state(p, "exp_avg_sq").clone(),
        }
    losses = _train(engine, range(SAVED_STEPS, SAVED_STEPS + MORE_STEPS), rank)
    torch.save({"state": state, "losses": losses}, Path(result_dir) / f"rank{rank}.pt")
    # Tear down explicitly: a ZeRO-3 process left to exit with its groups alive sometimes
    # aborts in C++ static destruction ("terminate called without an active exception").
    engine.destroy()
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _run_deepspeed(save_dir: Path, stage: int, result_dir: Path) -> list[dict]:
    result_dir.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cmd += [__file__, str(save_dir), str(stage), str(result_dir)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return [torch.load(result_dir / f"rank{r}.pt") for r in range(2)]


def _shardspeed_rank(ckpt_dir: str) -> dict:
    import shardspeed

    torch.manual_seed(999)  # different init: everything must come from the checkpoint
    model = make_model(ParitySpec(seed=999))
    engine, *_ = shardspeed.initialize(
        model=model, model_parameters=model.parameters(), config=_config(1, torch_adam=False)
    )
    path, _ = engine.load_checkpoint(ckpt_dir)
    assert path is not None
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    counters = (engine.global_steps, engine.global_samples, engine.lr_scheduler.state_dict())
    losses = _train(engine, range(SAVED_STEPS, SAVED_STEPS + MORE_STEPS), comm_rank())
    return {"params": params, "losses": losses, "counters": counters}


def comm_rank() -> int:
    return torch.distributed.get_rank()


def _imported(tag_dir: Path) -> dict[str, dict[str, torch.Tensor]]:
    from shardspeed.checkpoint.format import load_manifest
    from shardspeed.checkpoint.shards import SliceReader

    manifest = load_manifest(tag_dir)
    reader = SliceReader(tag_dir)
    return {
        name: {kind: reader.full(entry, kind, name) for kind in entry["kinds"]}
        for name, entry in manifest["index"].items()
    }


@pytest.mark.parametrize("ds_stage", [2, 3])
def test_import_deepspeed_and_resume(tmp_path: Path, ds_stage: int) -> None:
    pytest.importorskip(
        "deepspeed",
        reason="DeepSpeed is not installed (only in .venv-peers); this test needs a real "
        "DeepSpeed checkpoint",
    )
    from shardspeed.launcher.checkpoint_cmd import main as checkpoint_main

    ds_dir, out_dir = tmp_path / "ds", tmp_path / "ss"
    ds = _run_deepspeed(ds_dir, ds_stage, tmp_path / "ds_results")
    assert checkpoint_main(["from-deepspeed", str(ds_dir), str(out_dir)]) == 0
    assert (out_dir / "latest").read_text() == "global_step3"

    saved = _imported(out_dir / "global_step3")
    expected = ds[0]["state"]
    assert set(saved) == set(expected) - {"lm_head.weight"}  # tied to wte.weight
    assert ds[0]["state"]["wte.weight"]["exp_avg"].abs().max() > 1e-4  # real Adam state
    for name, kinds in saved.items():
        assert set(kinds) == {"master", "exp_avg", "exp_avg_sq"}, name
        for kind, value in kinds.items():
            torch.testing.assert_close(value, expected[name][kind], rtol=0, atol=1e-6)

    ours = run_distributed(_shardspeed_rank, 2, str(out_dir), timeout=300)
    for rank in range(2):
        assert len(ours[rank]["losses"]) == len(ds[rank]["losses"]) == MORE_STEPS
        assert ours[rank]["counters"] == (3, 12, {"last_batch_iteration": 2})
        for name, value in ours[rank]["params"].items():
            torch.testing.assert_close(value, expected[name]["master"], rtol=0, atol=1e-6)
        torch.testing.assert_close(
            torch.tensor(ours[rank]["losses"]),
            torch.tensor(ds[rank]["losses"]),
            rtol=1e-5,
            atol=1e-5,
        )


def test_from_deepspeed_rejects_missing_tag(tmp_path: Path, capsys) -> None:
    from shardspeed.launcher.checkpoint_cmd import main as checkpoint_main

    (tmp_path / "ds").mkdir()
    assert checkpoint_main(["from-deepspeed", str(tmp_path / "ds"), str(tmp_path / "o")]) == 2
    assert "no 'latest' file" in capsys.readouterr().err


def test_flat_group_splitting_honours_padding() -> None:
    """Odd sizes: ZeRO-1/2 pads the group's tail, ZeRO-3 pads every parameter's last chunk."""
    from shardspeed.checkpoint.deepspeed_import import _split_flat, _split_stage3

    shapes = {"a": torch.Size([3]), "b": torch.Size([2, 3])}
    full = {"a": torch.arange(3.0), "b": torch.arange(10.0, 16.0)}
    pad = torch.tensor([-1.0])
    z2 = [torch.cat([full["a"], full["b"][:3]]), torch.cat([full["b"][3:], pad, pad, pad])]
    z3 = [
        torch.cat([full["a"][:2], full["b"][:3]]),
        torch.cat([full["a"][2:], pad, full["b"][3:]]),
    ]
    for split, parts in ((_split_flat, z2), (_split_stage3, z3)):
        out = split(shapes, parts, "test")
        assert set(out) == {"a", "b"}
        for name in full:
            assert torch.equal(out[name], full[name]), (split.__name__, name)
    with pytest.raises(ValueError, match="parameter 'b' needs"):
        _split_flat(shapes, [z2[0][:4]], "test")


if __name__ == "__main__":  # a DeepSpeed rank, started by _run_deepspeed
    _deepspeed_rank(sys.argv[1], int(sys.argv[2]), sys.argv[3])
