"""``shardspeed checkpoint to-fp32`` streams: its peak memory is bounded by one shard.

A 52M-parameter demo GPT is trained for one step on 2 ranks (ZeRO stage 2, fp32, AdamW, so
the checkpoint holds masters plus ``exp_avg``/``exp_avg_sq``) and saved. The CLI then runs
in a fresh process; its peak RSS minus the peak RSS of a process that only imports the same
libraries must stay below 1.5 x (largest output shard file + largest tensor). The result
must load into the model with ``strict=True`` and equal the trained parameters.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shardspeed.models import GPT, GPTConfig
from shardspeed.testing import run_distributed

REPO_ROOT = Path(__file__).resolve().parents[2]
GPT_SHAPE = {"n_layer": 8, "n_embd": 736, "n_head": 8, "block_size": 16}  # 52.3M params

# Runs ``argv`` in a child and prints the child's peak RSS (ru_maxrss, KiB on Linux). The
# wrapper has no other children, so RUSAGE_CHILDREN is exactly that one process.
_MEASURE = """
import resource, subprocess, sys
proc = subprocess.run(sys.argv[1:], capture_output=True, text=True)
sys.stderr.write(proc.stdout + proc.stderr)
print("MAXRSS_KIB", resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, proc.returncode)
"""
_BASELINE = "import torch, safetensors.torch, shardspeed, shardspeed.checkpoint.consolidate"


def _save_rank(ckpt: str, trained: str) -> int:
    import shardspeed
    from shardspeed import comm

    torch.manual_seed(0)
    model = GPT(GPTConfig(**GPT_SHAPE))
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    }
    engine, *_ = shardspeed.initialize(model=model, config=config)
    tokens = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(comm.get_rank()))
    _, loss = engine(tokens[:, :-1], tokens[:, 1:])
    engine.backward(loss)
    engine.step()
    engine.save_checkpoint(ckpt)
    if comm.get_rank() == 0:
        from safetensors.torch import save_file

        params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
        save_file(params, trained)
    n_params = sum(p.numel() for p in engine.module.parameters())
    engine.destroy()
    return n_params


def _peak_rss_bytes(argv: list[str]) -> int:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT))
    proc = subprocess.run(
        [sys.executable, "-c", _MEASURE, *argv],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO_ROOT,
        timeout=300,
    )
    line = next(x for x in proc.stdout.splitlines() if x.startswith("MAXRSS_KIB"))
    _, kib, code = line.split()
    assert int(code) == 0, f"{argv} failed:\n{proc.stderr[-3000:]}"
    return int(kib) * 1024


# Suite time (13 s: a 50M-parameter checkpoint saved and consolidated twice): in make
# test-slow. The CLI's results are checked in make test by test_deepspeed_api_dist.py's
# zero_to_fp32 case and the consolidation tests of test_checkpoint_engine.py.
@pytest.mark.slow
def test_to_fp32_cli_peak_rss_is_bounded_by_one_shard(tmp_path: Path) -> None:
    ckpt, out, trained = tmp_path / "ckpt", tmp_path / "out", tmp_path / "trained.safetensors"
    n_params = run_distributed(_save_rank, 2, str(ckpt), str(trained), timeout=300)[0]
    assert n_params >= 50_000_000, n_params

    baseline = _peak_rss_bytes([sys.executable, "-c", _BASELINE])
    cli = [sys.executable, "-m", "shardspeed.launcher", "checkpoint", "to-fp32"]
    peak = _peak_rss_bytes([*cli, str(ckpt), str(out), "--safetensors"])

    from safetensors.torch import load_file

    files = sorted(out.glob("*.safetensors"))
    assert [f.name for f in files] == ["model.safetensors"]
    largest_shard = max(f.stat().st_size for f in files)
    state = load_file(str(files[0]))
    largest_tensor = max(t.numel() * t.element_size() for t in state.values())
    increment = peak - baseline
    bound = 1.5 * (largest_shard + largest_tensor)
    mib = 2**20
    assert increment < bound, (
        f"to-fp32 peak RSS {peak / mib:.0f} MiB - baseline {baseline / mib:.0f} MiB = "
        f"{increment / mib:.0f} MiB exceeds 1.5 x (shard {largest_shard / mib:.0f} MiB + "
        f"tensor {largest_tensor / mib:.1f} MiB) = {bound / mib:.0f} MiB"
    )

    model = GPT(GPTConfig(**GPT_SHAPE))
    model.load_state_dict(state, strict=True)
    expected = load_file(str(trained))
    for name, param in model.named_parameters():
        assert torch.equal(param.detach(), expected[name]), name
    assert torch.equal(state["lm_head.weight"], state["wte.weight"])
    print(
        f"params={n_params} baseline={baseline / mib:.0f}MiB peak={peak / mib:.0f}MiB "
        f"increment={increment / mib:.0f}MiB bound={bound / mib:.0f}MiB"
    )
