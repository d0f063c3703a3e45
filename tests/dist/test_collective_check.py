"""Hang safety on gloo: the every-N-steps collective-sequence check and timeout reports.

* Stage 2 has no per-collective order check: a data-dependent branch that makes the ranks
  issue different collectives (same size, different module; or one extra collective)
  must fail at the next sequence check with a report naming each rank's first divergent
  collective, and never hang.
* Consistent runs (stage 2, stage 3, a pp=2 x dp=2 pipeline) pass the check.
* A collective that one rank skips raises ``CollectiveTimeoutError`` within the (short)
  process-group timeout, naming the collective, its module tag and the last collectives.
  The harness's world group has a long timeout, so the tests make a short-timeout group
  with ``comm.new_group(timeout=...)``; a subprocess test (slow) covers
  ``SHARDSPEED_COMM_TIMEOUT`` on the world group made by ``init_distributed``.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn

from shardspeed import comm
from shardspeed.testing import run_distributed

DIVERGE_AT = 2  # 0-based loop index of the step whose forward diverges
SHORT_TIMEOUT = timedelta(seconds=2)


class _Branchy(nn.Module):
    """An MLP whose forward, on one step, runs a rank-dependent collective."""

    def __init__(self, mode: str, singles: list[Any]) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 1)
        self.mode = mode
        self.singles = singles  # per-rank singleton groups (made on every rank)
        self.step = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))  # (B, 8)
        if self.step == DIVERGE_AT:
            rank = comm.get_rank()
            stats = h.detach().sum(0)  # (8,)
            if self.mode == "different":  # same size, different module: pairs up silently
                with comm.set_current_tag(f"moe.expert_{'ab'[rank]}"):
                    comm.all_reduce(stats)
            elif rank == 1:  # "extra": only rank 1 reduces, over a group of itself
                with comm.set_current_tag("aux.rank1_only"):
                    comm.all_reduce(stats, group=self.singles[1])
        return self.b(h).pow(2).mean()


def _train_stage2(mode: str, interval: int, steps: int) -> dict[str, Any]:
    import shardspeed

    singles = [comm.new_group([r]) for r in range(comm.get_world_size())]
    torch.manual_seed(0)
    model = _Branchy(mode, singles)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": 2},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "collective_check": {"enabled": True, "interval": interval},
        "steps_per_print": 1000,
    }
    engine, _, _, _ = shardspeed.initialize(model=model, config=config)
    done = 0
    try:
        for i in range(steps):
            model.step = i
            x = torch.randn(2, 8, generator=torch.Generator().manual_seed(i + 10 * comm.get_rank()))
            engine.backward(engine(x))
            engine.step()
            done += 1
    except comm.CollectiveMismatchError as err:
        return {"done": done, "error": str(err)}
    finally:
        engine.destroy()
    return {"done": done, "error": None}


def test_stage2_different_module_fails_at_next_check_with_report() -> None:
    t0 = time.monotonic()
    results = run_distributed(_train_stage2, 2, "different", 2, 6, timeout=60)
    assert time.monotonic() - t0 < 30
    for rank, r in enumerate(results):
        # the forward of step index 2 diverged; the check after optimizer step 4 caught it
        assert r["done"] == 3, r
        text = r["error"]
        assert "collective sequences diverged across ranks [0, 1]" in text
        assert "found at optimizer step 4" in text and f"this is rank {rank}" in text
        assert "first divergent collective: #" in text
        assert "-> #" in text and "module/phase='moe.expert_a'" in text
        assert "module/phase='moe.expert_b'" in text
        # the collectives before it on every rank: the previous step's bucket reductions
        assert "zero2.reduce_grads group 0 bucket 0" in text
        assert "module/phase='optimizer.step'" in text  # grad norm, parameter all-gather
    assert (
        results[0]["error"].split("this is rank")[1][2:]
        == results[1]["error"].split("this is rank")[1][2:]
    )


def test_stage2_extra_collective_on_one_rank_is_reported() -> None:
    results = run_distributed(_train_stage2, 2, "extra", 1, 5, timeout=60)
    for r in results:
        assert r["done"] == DIVERGE_AT, r  # raised by the check right after that step
        text = r["error"]
        rank0, rank1 = text.split("  rank 1:")
        assert "-> #" in rank0 and "zero2.reduce_grads group 0 bucket 0" in rank0.split("-> ")[-1]
        assert "group=[1] module/phase='aux.rank1_only'" in rank1.split("-> ")[-1]


def _consistent_runs() -> dict[str, Any]:
    import shardspeed
    from shardspeed.models import GPT, GPTConfig

    out: dict[str, Any] = {}
    for stage in (2, 3):
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16))
        config = {
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 2,
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "collective_check": {"enabled": True, "interval": 1},
            "steps_per_print": 1000,
        }
        engine, _, _, _ = shardspeed.initialize(model=model, config=config)
        for i in range(6):
            g = torch.Generator().manual_seed(i * 2 + comm.get_rank())
            x = torch.randint(0, 32, (2, 8), generator=g)
            _, loss = engine(x, x)
            engine.backward(loss)
            engine.step()
        out[f"stage{stage}"] = {
            "steps": engine.global_steps,
            "tags": sorted({str(r["tag"]) for r in comm.recent_ops()}),
        }
        engine.destroy()
    return out


def test_consistent_stage2_and_stage3_runs_pass_the_check_and_tag_modules() -> None:
    for r in run_distributed(_consistent_runs, 2, timeout=90):
        assert r["stage2"]["steps"] == r["stage3"]["steps"] == 3
        assert "zero2.reduce_grads group 0 bucket 0" in r["stage2"]["tags"]
        tags3 = r["stage3"]["tags"]
        assert "zero3.gather unit <root>" in tags3, tags3
        assert {"zero3.gather unit h.1", "zero3.prefetch unit h.1"} & set(tags3), tags3
        assert any(t.startswith("zero3.reduce_grads unit h.") for t in tags3), tags3
        assert "collective_check" in tags3  # the check ran (but was not recorded)


def _pipeline_with_check() -> float:
    sys.path.insert(0, str(Path(__file__).parent))
    from test_pipe_engine import PipeSpec, pipeline_run

    spec = PipeSpec(pp=2, dp=2, m=2, extra={"collective_check": {"enabled": True, "interval": 1}})
    losses, _, _ = pipeline_run(spec)
    return losses[-1]


def test_pipeline_dp_peers_pass_the_check() -> None:
    losses = run_distributed(_pipeline_with_check, 4, timeout=90)
    assert len(losses) == 4 and all(torch.isfinite(torch.tensor(x)) for x in losses)


# ----------------------------------------------------------------------- timeouts
def _skip_one_collective(async_op: bool) -> dict[str, Any]:
    group = comm.new_group([0, 1], timeout=SHORT_TIMEOUT)
    t = torch.ones(4)
    with comm.set_current_tag("block.3.attn"):
        comm.all_reduce(t, group=group)  # both ranks: fine
    if comm.get_rank() == 1:
        return {"rank": 1}  # skips the next collective
    start = time.monotonic()
    try:
        with comm.set_current_tag("block.4.mlp"):
            work = comm.all_reduce(t, group=group, async_op=async_op)
            if async_op:
                work.wait()
    except comm.CollectiveTimeoutError as err:
        return {"rank": 0, "seconds": time.monotonic() - start, "error": str(err)}
    return {"rank": 0, "error": None}


@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async-wait"])
def test_skipped_collective_times_out_with_report(async_op: bool) -> None:
    r0, r1 = run_distributed(_skip_one_collective, 2, async_op, timeout=60)
    assert r1 == {"rank": 1}
    assert r0["error"] is not None and r0["seconds"] < 10
    text = r0["error"]
    how = "wait() on all_reduce" if async_op else "all_reduce"
    assert text.startswith(f"rank 0 (of 2): {how} timed out after the process-group timeout (2 s)")
    assert "numel=4 dtype=float32 group=[0, 1] module/phase='block.4.mlp'" in text
    assert "module/phase: block.4.mlp" in text
    assert "module/phase='block.3.attn'" in text  # the collective before it
    assert "Another rank of group [0, 1] did not reach this collective" in text


class _Mpu:
    """Hands the engine a data-parallel group with a short timeout."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def get_data_parallel_group(self) -> Any:
        return self.group


def _engine_rank_stops_early() -> dict[str, Any]:
    import shardspeed

    group = comm.new_group([0, 1], timeout=SHORT_TIMEOUT)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": 2},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "steps_per_print": 1000,
    }
    engine, _, _, _ = shardspeed.initialize(model=model, config=config, mpu=_Mpu(group))
    steps = 2 if comm.get_rank() == 0 else 1  # rank 1 leaves the loop early
    try:
        for _ in range(steps):
            engine.backward(engine(torch.randn(2, 8)).pow(2).mean())
            engine.step()
    except comm.CollectiveTimeoutError as err:
        return {"error": str(err)}
    finally:
        engine.reducer.remove_hooks()
    return {"error": None}


def test_engine_reduction_timeout_names_the_bucket() -> None:
    r0, r1 = run_distributed(_engine_rank_stops_early, 2, timeout=60)
    assert r1["error"] is None
    text = r0["error"]
    assert "rank 0 (of 2): wait() on all_reduce timed out" in text
    assert "module/phase: zero2.reduce_grads group 0 bucket 0" in text


_SUBPROCESS_RANK = textwrap.dedent(
    """
    import sys, time, torch
    from shardspeed import comm
    comm.init_distributed(dist_backend="gloo", verbose=False)
    t = torch.ones(3)
    comm.all_reduce(t)
    if comm.get_rank() == 1:
        time.sleep(8)  # alive but never joins: rank 0 must time out (not see a dead peer)
    else:
        try:
            with comm.set_current_tag("train.step"):
                comm.all_reduce(t)
        except comm.CollectiveTimeoutError as err:
            print("REPORT", err)
            sys.exit(3)
    """
)


@pytest.mark.slow
def test_init_distributed_timeout_from_environment(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "rank.py"
    script.write_text(_SUBPROCESS_RANK)
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank))
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), SHARDSPEED_COMM_TIMEOUT="3")
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script)], env=env, stdout=subprocess.PIPE, text=True
            )
        )
    out0, _ = procs[0].communicate(timeout=120)
    procs[1].communicate(timeout=120)
    assert procs[0].returncode == 3, out0
    assert "rank 0 (of 2): all_reduce timed out after the process-group timeout (3 s)" in out0
    assert "module/phase: train.step" in out0
