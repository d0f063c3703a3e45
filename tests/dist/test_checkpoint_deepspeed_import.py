"""Importing a real DeepSpeed 0.19 ZeRO-2/3 checkpoint and resuming it in ShardSpeed.

DeepSpeed (world 2, ZeRO-2 or ZeRO-3, fp32, torch AdamW, WarmupLR) trains the parity GPT for 3 steps
and saves; ``shardspeed checkpoint from-deepspeed`` converts the folder; a ShardSpeed
engine (world 2, ZeRO-1) loads it. Parameters and Adam moments equal DeepSpeed's
consolidated ones (1e-6) and 2 further steps give DeepSpeed's losses (1e-5).

DeepSpeed's checkpoint folders (``global_step3``, without its ``zero_to_fp32.py``) and its
consolidated state (masters; Adam moments as sha256, imported bit for bit) and losses are
checked in under ``tests/goldens/checkpoint_import/`` (the
golden variant, run everywhere, with no DeepSpeed installed); the live variant runs
DeepSpeed where the peers venv has it (``tests/goldens/README.md``).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from goldens import deepspeed_oracle as golden
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


def _run_deepspeed(save_dir: Path, stage: int, result_dir: Path) -> dict:
    """DeepSpeed's run: its consolidated state at the save (the same on every rank) and
    each rank's losses after it."""
    result_dir.mkdir()
    cmd = [golden.live_python(), "-m", "torch.distributed.run", "--standalone"]
    cmd += ["--nproc_per_node", "2", __file__, str(save_dir), str(stage), str(result_dir)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=golden.live_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    ranks = [torch.load(result_dir / f"rank{r}.pt") for r in range(2)]
    return {"state": ranks[0]["state"], "losses": [r["losses"] for r in ranks]}


def _compress(ds: dict) -> dict:
    """The golden keeps the masters; the Adam moments (the import copies them bit for bit)
    as one sha256 each."""
    state = {
        name: {k: v if k == "master" else golden.fingerprint([v]) for k, v in kinds.items()}
        for name, kinds in ds["state"].items()
    }
    return {**ds, "state": state, "recorded_with": golden.recorded_with()}


def _assert_imported(value: torch.Tensor, expected: torch.Tensor | str, what: str) -> None:
    if isinstance(expected, str):  # the golden's sha256: bit-identical
        assert golden.fingerprint([value]) == expected, f"{what} differs from DeepSpeed's"
    else:
        torch.testing.assert_close(value, expected, rtol=0, atol=1e-6, msg=what)


def _deepspeed_checkpoint(source: str, stage: int, tmp_path: Path) -> tuple[Path, dict]:
    """(DeepSpeed's checkpoint folder, its run's results): checked in, or written live."""
    topic, folder = "checkpoint_import", f"zero{stage}"
    recorded = golden.golden_path(topic, folder)
    if source == "golden":
        return recorded / "checkpoint", golden.load(topic, f"{folder}/expected.pt")
    ds_dir = tmp_path / "ds"
    ds = _run_deepspeed(ds_dir, stage, tmp_path / "ds_results")
    if golden.recording():
        shutil.rmtree(recorded / "checkpoint", ignore_errors=True)
        # zero_to_fp32.py: DeepSpeed's consolidation script, copied into every save folder
        shutil.copytree(ds_dir, recorded / "checkpoint", ignore=shutil.ignore_patterns("*.py"))
        golden.save(topic, f"{folder}/expected.pt", _compress(ds))
    return ds_dir, ds


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


@pytest.mark.parametrize("source", golden.ORACLE_SOURCES)
@pytest.mark.parametrize("ds_stage", [2, 3])
def test_import_deepspeed_and_resume(tmp_path: Path, ds_stage: int, source: str) -> None:
    from shardspeed.launcher.checkpoint_cmd import main as checkpoint_main

    ds_dir, ds = _deepspeed_checkpoint(source, ds_stage, tmp_path)
    out_dir = tmp_path / "ss"
    assert checkpoint_main(["from-deepspeed", str(ds_dir), str(out_dir)]) == 0
    assert (out_dir / "latest").read_text() == "global_step3"

    saved = _imported(out_dir / "global_step3")
    expected = ds["state"]
    assert set(saved) == set(expected) - {"lm_head.weight"}  # tied to wte.weight
    assert saved["wte.weight"]["exp_avg"].abs().max() > 1e-4  # real Adam state
    for name, kinds in saved.items():
        assert set(kinds) == {"master", "exp_avg", "exp_avg_sq"}, name
        for kind, value in kinds.items():
            _assert_imported(value, expected[name][kind], f"{name} {kind}")

    ours = run_distributed(_shardspeed_rank, 2, str(out_dir), timeout=300)
    for rank in range(2):
        assert len(ours[rank]["losses"]) == len(ds["losses"][rank]) == MORE_STEPS
        assert ours[rank]["counters"] == (3, 12, {"last_batch_iteration": 2})
        for name, value in ours[rank]["params"].items():
            torch.testing.assert_close(value, expected[name]["master"], rtol=0, atol=1e-6)
        torch.testing.assert_close(
            torch.tensor(ours[rank]["losses"]),
            torch.tensor(ds["losses"][rank]),
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
