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
routing (``exp_counts``, initial weights) exact. DeepSpeed's results are recorded in
``tests/goldens/moe/oracle_layer.pt.gz`` (initial weights as a sha256 each, parameter
gradients as summaries: norm, sums, 16 entries; the golden variant, run everywhere); the live variant runs where the peers venv has DeepSpeed
(``tests/goldens/README.md``).
"""

from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from goldens import deepspeed_oracle as golden

from shardspeed.testing import run_distributed

ROOT = Path(__file__).resolve().parents[2]
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


def _fingerprint_init(results: dict[str, Any]) -> dict[str, Any]:
    """Initial weights as one sha256 per parameter: they must be bit-equal anyway."""
    return {
        name: {**value, "init": {n: golden.fingerprint([t]) for n, t in value["init"].items()}}
        if name in CASES
        else value
        for name, value in results.items()
    }


def _compress(data: dict[str, Any]) -> dict[str, Any]:
    """The golden keeps parameter gradients as summaries (norm, sums, 16 entries)."""

    def case(v: dict[str, Any]) -> dict[str, Any]:
        grads = {n: golden.summarize(g) for n, g in v["grads"].items()}
        small = {"l_aux": v["l_aux"].tolist(), "exp_counts": v["exp_counts"].tolist()}
        return {**v, "grads": grads, **small}  # a tensor record costs 1.5 kB in a .pt

    def one(results: dict[str, Any]) -> dict[str, Any]:
        return {name: case(v) if name in CASES else v for name, v in results.items()}

    return {**data, "ranks": [one(rank) for rank in data["ranks"]]}


def _run_deepspeed(result_dir: Path) -> dict[str, Any]:
    cmd = [golden.live_python(), "-m", "torch.distributed.run", "--standalone"]
    cmd += ["--nproc_per_node", "2", __file__, str(result_dir)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=golden.live_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    ranks = [torch.load(result_dir / f"rank{r}.pt") for r in range(2)]
    return {"ranks": [_fingerprint_init(rank) for rank in ranks]}


@pytest.mark.parametrize("source", golden.ORACLE_SOURCES)
def test_moe_matches_deepspeed(source: str, tmp_path: Path) -> None:
    theirs = golden.deepspeed_side(
        source, "moe", "oracle_layer.pt.gz", lambda: _run_deepspeed(tmp_path), _compress
    )
    ds = theirs["ranks"]
    ours = [_fingerprint_init(rank) for rank in _ours()]
    for rank in range(2):
        assert ours[rank]["optimizer_groups"] == ds[rank]["optimizer_groups"]
        for name in CASES:
            mine, theirs = ours[rank][name], ds[rank][name]
            where = f"rank {rank} case {name}"
            assert mine["init"] == theirs["init"], f"{where}: initial weights differ"
            assert torch.equal(mine["exp_counts"], torch.as_tensor(theirs["exp_counts"])), where
            for key in ("out", "l_aux", "x_grad"):
                expected = torch.as_tensor(theirs[key], dtype=mine[key].dtype)
                torch.testing.assert_close(mine[key], expected, **TOL, msg=f"{where}: {key}")
            assert mine["grads"].keys() == theirs["grads"].keys(), where
            for pname, value in theirs["grads"].items():
                if isinstance(value, dict):  # the golden's summary
                    golden.assert_close_summary(
                        mine["grads"][pname], value, **TOL, msg=f"{where}: grad {pname}"
                    )
                    continue
                torch.testing.assert_close(
                    mine["grads"][pname], value, **TOL, msg=f"{where}: grad {pname}"
                )


@functools.cache
def _ours() -> list[dict[str, Any]]:
    """ShardSpeed's results per rank (once: both variants compare with them)."""
    return run_distributed(_shardspeed_rank, 2, timeout=120)


if __name__ == "__main__":  # a DeepSpeed rank, started by _run_deepspeed
    _deepspeed_rank(sys.argv[1])
