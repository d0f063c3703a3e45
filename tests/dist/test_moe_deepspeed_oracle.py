"""ShardSpeed's MoE against DeepSpeed 0.19.8's, built the same way on 2 gloo ranks.

The same function (:func:`_run_cases`) runs under DeepSpeed (``.venv-peers``, started with
``torch.distributed.run``: DeepSpeed keeps its groups in module globals, so it cannot share
the harness's reused workers) and under ShardSpeed (``run_distributed``). Per case it
seeds, builds ``MoE(hidden, expert, ...)``, records the initial parameters (same seed,
same weights), perturbs each expert by its global id (so experts differ and routing
mistakes show), seeds the forward (RTS, Gumbel and jitter draw from it), and records
output, ``l_aux``, ``exp_counts`` and every gradient of ``(out * w).sum() + l_aux``.

Cases: top-1 with RTS, without RTS (DeepSpeed's tie order), no-drop, RSample, Jitter,
``used_token``, eval capacity; top-2 with and without second-expert sampling, drop and
no-drop; top-3 (DeepSpeed's ``topkgating``); residual MoE; ep 1 and 2. Also the
optimizer groups of ``split_params_into_different_moe_groups_for_optimizer``.

Tolerance (fp32, as ``tests/dist/parity_common.py``'s fp32 runs): rtol 1e-5, atol 1e-6;
routing (``exp_counts``, initial weights) exact. Without ``.venv-peers`` (CI) it skips.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from shardspeed.testing import run_distributed

ROOT = Path(__file__).resolve().parents[2]
PEERS_PYTHON = ROOT / ".venv-peers" / "bin" / "python"
TOL = {"rtol": 1e-5, "atol": 1e-6}

HIDDEN, FFN, EXPERTS, BATCH, SEQ = 8, 16, 4, 2, 8  # 16 tokens per rank
CASES: dict[str, dict[str, Any]] = {
    "top1_rts_drop": {"ep_size": 2, "k": 1, "capacity_factor": 0.5, "min_capacity": 1},
    "top1_no_rts_drop": {
        "ep_size": 2, "k": 1, "capacity_factor": 0.5, "min_capacity": 1, "use_rts": False,
    },
    "top1_no_drop": {"ep_size": 2, "k": 1, "drop_tokens": False},
    "top1_rsample": {"ep_size": 2, "k": 1, "noisy_gate_policy": "RSample", "min_capacity": 1},
    "top1_jitter_ep1": {"ep_size": 1, "k": 1, "noisy_gate_policy": "Jitter", "min_capacity": 1},
    "top1_used_token": {"ep_size": 2, "k": 1, "capacity_factor": 0.5, "min_capacity": 1},
    "top1_eval": {
        "ep_size": 2, "k": 1, "capacity_factor": 2.0, "eval_capacity_factor": 0.25,
        "min_capacity": 1, "noisy_gate_policy": "RSample",
    },
    "top2_drop": {"ep_size": 2, "k": 2, "capacity_factor": 0.5, "min_capacity": 1},
    "top2_no_drop": {"ep_size": 2, "k": 2, "drop_tokens": False},
    "top2_no_sampling_ep1": {
        "ep_size": 1, "k": 2, "capacity_factor": 0.5, "min_capacity": 1,
        "top2_2nd_expert_sampling": False,
    },
    "top3_drop": {"ep_size": 2, "k": 3, "capacity_factor": 0.5, "min_capacity": 1},
    "top3_no_drop": {"ep_size": 2, "k": 3, "drop_tokens": False},
    "residual_top2": {
        "ep_size": 2, "k": 2, "capacity_factor": 0.5, "min_capacity": 1, "use_residual": True,
    },
}  # fmt: skip


def _run_cases(moe_class: Any, split_groups: Any) -> dict[str, Any]:
    """Every case on this rank; only torch and the given callables (runs under both)."""
    rank = torch.distributed.get_rank()
    results: dict[str, Any] = {}
    for index, (name, kwargs) in enumerate(CASES.items()):
        seed = 100 + index
        torch.manual_seed(seed)
        expert = torch.nn.Sequential(
            torch.nn.Linear(HIDDEN, FFN), torch.nn.GELU(), torch.nn.Linear(FFN, HIDDEN)
        )
        moe = moe_class(HIDDEN, expert, num_experts=EXPERTS, **kwargs)
        if hasattr(moe, "set_deepspeed_parallelism"):
            moe.set_deepspeed_parallelism()  # DeepSpeed's engine does this in initialize()
        init = {n: p.detach().clone() for n, p in moe.named_parameters()}
        ep, local = kwargs["ep_size"], EXPERTS // kwargs["ep_size"]
        with torch.no_grad():
            for i, module in enumerate(moe.deepspeed_moe.experts.deepspeed_experts):
                g = torch.Generator().manual_seed(1000 + (rank % ep) * local + i)
                for p in module.parameters():
                    p.add_(0.2 * torch.randn(p.shape, generator=g))
        g = torch.Generator().manual_seed(seed * 10 + rank)
        x = torch.randn(BATCH, SEQ, HIDDEN, generator=g).requires_grad_()
        w = torch.randn(BATCH, SEQ, HIDDEN, generator=g)
        used = (torch.rand(BATCH * SEQ, generator=g) < 0.75).long()
        moe.train(name != "top1_eval")
        torch.manual_seed(seed * 10 + 5 + rank)  # the forward's random draws
        out, l_aux, counts = moe(x, used) if name == "top1_used_token" else moe(x)
        ((out * w).sum() + l_aux).backward()
        grads = {n: p.grad.clone() for n, p in moe.named_parameters() if p.grad is not None}
        results[name] = {
            "init": init, "out": out.detach(), "l_aux": l_aux.detach(),
            "exp_counts": counts.clone(), "x_grad": x.grad.clone(), "grads": grads,
        }  # fmt: skip
        if name == "residual_top2":
            names = {id(p): n for n, p in moe.named_parameters()}
            groups = split_groups([{"name": "all", "params": list(moe.parameters()), "lr": 0.1}])
            results["optimizer_groups"] = [
                (gr["name"], gr.get("moe", False), gr["lr"], [names[id(p)] for p in gr["params"]])
                for gr in groups
            ]
    return results


def _deepspeed_rank(result_dir: str) -> None:
    """One DeepSpeed rank (under torch.distributed.run in the peers venv)."""
    import deepspeed
    import deepspeed.comm.torch as ds_comm_torch
    from deepspeed.moe.layer import MoE
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    ds_comm_torch.build_shm_op = lambda: None  # skip a JIT build the gloo test never uses
    deepspeed.init_distributed(dist_backend="gloo")
    torch.set_num_threads(1)
    results = _run_cases(MoE, split_params_into_different_moe_groups_for_optimizer)
    rank = torch.distributed.get_rank()
    torch.save(results, Path(result_dir) / f"rank{rank}.pt")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _shardspeed_rank() -> dict[str, Any]:
    from shardspeed.moe.layer import MoE
    from shardspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    return _run_cases(MoE, split_params_into_different_moe_groups_for_optimizer)


def _peers_have_deepspeed() -> bool:
    if not PEERS_PYTHON.exists():
        return False
    find = "import importlib.util, sys; sys.exit(importlib.util.find_spec('deepspeed') is None)"
    return subprocess.run([str(PEERS_PYTHON), "-c", find], capture_output=True).returncode == 0


def _run_deepspeed(result_dir: Path) -> list[dict[str, Any]]:
    cmd = [str(PEERS_PYTHON), "-m", "torch.distributed.run", "--standalone", "--nproc_per_node"]
    cmd += ["2", __file__, str(result_dir)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return [torch.load(result_dir / f"rank{r}.pt") for r in range(2)]


def test_moe_matches_deepspeed(tmp_path: Path) -> None:
    if not _peers_have_deepspeed():
        pytest.skip(
            f"DeepSpeed 0.19.8 is not installed in {PEERS_PYTHON.parent.parent} (CI has no "
            "peers venv); this oracle test needs it"
        )
    ds = _run_deepspeed(tmp_path)
    ours = run_distributed(_shardspeed_rank, 2, timeout=120)
    for rank in range(2):
        assert ours[rank]["optimizer_groups"] == ds[rank]["optimizer_groups"]
        for name in CASES:
            mine, theirs = ours[rank][name], ds[rank][name]
            where = f"rank {rank} case {name}"
            assert mine["init"].keys() == theirs["init"].keys(), where
            for pname, value in theirs["init"].items():
                assert torch.equal(mine["init"][pname], value), f"{where}: init {pname}"
            assert torch.equal(mine["exp_counts"], theirs["exp_counts"]), where
            for key in ("out", "l_aux", "x_grad"):
                torch.testing.assert_close(mine[key], theirs[key], **TOL, msg=f"{where}: {key}")
            assert mine["grads"].keys() == theirs["grads"].keys(), where
            for pname, value in theirs["grads"].items():
                torch.testing.assert_close(
                    mine["grads"][pname], value, **TOL, msg=f"{where}: grad {pname}"
                )


if __name__ == "__main__":  # a DeepSpeed rank, started by _run_deepspeed
    _deepspeed_rank(sys.argv[1])
