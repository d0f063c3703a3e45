"""MoE training with bf16 parameters against DeepSpeed 0.19.8: the clipping norm and losses.

One client (``moe_bf16_oracle_worker.py``) trains ``dense -> MoE(ep_size=2) -> head`` with
bf16, GAS 2 and gradient clipping 0.05 under DeepSpeed (``.venv-peers``) and under
ShardSpeed. At ZeRO stage 0 DeepSpeed's 16-bit wrapper picks the norm:

* a client ``torch.optim.Adam`` (``FP16_UnfusedOptimizer``): the norm of the dense
  gradients alone, experts left out (0.1292 at the first step on 2 ranks, where the true
  norm is 0.1326 and the fp32 rule, the mean of the ranks' norms, 0.1309);
* ``"optimizer": {"type": "Adam"}`` (``FusedAdam``, ``FP16_Optimizer``): the true norm.

The DeepSpeed run also records both reference norms, so the test first checks that
DeepSpeed followed the rule above, then that ShardSpeed's ``get_global_grad_norm()``
equals DeepSpeed's at the first step (fp32 rounding: rtol 1e-5). Every later step depends
on the first update: DeepSpeed's 16-bit stage-0 wrappers also step the optimizer once with
zero gradients when built (``initialize_optimizer_states``: Adam's first real update is
then about 0.74 lr, not lr), which ShardSpeed's engine reproduces by default (config
``initial_zero_grad_step``), so the whole trajectory matches too: losses within the
issue's 2e-3, norms within 1e-3 (after an update DeepSpeed's FusedAdam and torch's Adam
may round a bf16 parameter apart). The 4-rank runs (ep 2 x expert_data 2, ZeRO 0/1/2) are
``slow``. Skips without ``.venv-peers``.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from moe_bf16_oracle_worker import Case, shardspeed_rank

from shardspeed.testing import run_distributed

ROOT = Path(__file__).resolve().parents[2]
PEERS_PYTHON = ROOT / ".venv-peers" / "bin" / "python"
WORKER = Path(__file__).with_name("moe_bf16_oracle_worker.py")
LOSS_TOL = {"rtol": 0.0, "atol": 2e-3}  # the bar for per-step losses
NORM_TOL = {"rtol": 1e-5, "atol": 0.0}  # same bf16 gradients, norms summed in fp32
# after an update: DeepSpeed's FusedAdam and torch's Adam may round a bf16 parameter apart
LATER_NORM_TOL = {"rtol": 1e-3, "atol": 0.0}
CASES: list[Case] = [(0, k, opt) for k in (1, 2) for opt in ("client", "config")]


def _peers_have_deepspeed() -> bool:
    if not PEERS_PYTHON.exists():
        return False
    find = "import importlib.util, sys; sys.exit(importlib.util.find_spec('deepspeed') is None)"
    return subprocess.run([str(PEERS_PYTHON), "-c", find], capture_output=True).returncode == 0


def _run_both(result_dir: Path, world: int, cases: list[Case]) -> tuple[list[Any], list[Any]]:
    """(DeepSpeed's, ShardSpeed's) results per rank."""
    if not _peers_have_deepspeed():
        pytest.skip(
            f"DeepSpeed 0.19.8 is not installed in {PEERS_PYTHON.parent.parent} (CI has no "
            "peers venv); this oracle test needs it"
        )
    cmd = [str(PEERS_PYTHON), "-m", "torch.distributed.run", "--standalone"]
    cmd += ["--nproc_per_node", str(world), str(WORKER), str(result_dir)]
    cmd += [f"{stage}:{k}:{opt}" for stage, k, opt in cases]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    ds = [torch.load(result_dir / f"rank{r}.pt") for r in range(world)]
    return ds, run_distributed(shardspeed_rank, world, cases, timeout=300)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Any], list[Any]]:
    return _run_both(tmp_path_factory.mktemp("moe_bf16_ds"), 2, CASES)


def _check_deepspeed_rule(theirs: dict[str, Any], opt: str, where: str) -> None:
    """DeepSpeed's stage-0 bf16 norm is the dense-only one (client optimizer) or the true
    one (FusedAdam), and the two differ here (the case can tell the rules apart)."""
    first = theirs["refs"][0]
    assert first["true"] > first["dense"] * 1.01, where
    rule = "dense" if opt == "client" else "true"
    torch.testing.assert_close(
        torch.tensor(theirs["norms"][0]), torch.tensor(first[rule]), rtol=1e-5, atol=0.0,
        msg=f"{where}: DeepSpeed's norm is not the {rule!r} rule",
    )  # fmt: skip


def test_moe_bf16_stage0_first_clipping_norm_matches_deepspeed(
    two_ranks: tuple[list[Any], list[Any]],
) -> None:
    ds, ours = two_ranks
    for rank in range(2):
        for case in CASES:
            mine, theirs = ours[rank][case], ds[rank][case]
            where = f"rank {rank} (stage, k, optimizer) = {case}"
            _check_deepspeed_rule(theirs, case[2], where)
            torch.testing.assert_close(
                torch.tensor(mine["norms"][0]), torch.tensor(theirs["norms"][0]), **NORM_TOL,
                msg=f"{where}: first-step clipping norm",
            )  # fmt: skip
            assert min(mine["norms"]) > 0.05, f"{where}: clipping must be active"
            # the first step's micro-batches run before any update: the same bf16 forward
            first = slice(0, 2)
            torch.testing.assert_close(
                torch.tensor(mine["losses"][first]), torch.tensor(theirs["losses"][first]),
                rtol=0.0, atol=0.0, msg=f"{where}: first-step losses",
            )  # fmt: skip


def test_moe_bf16_stage0_trajectory_matches_deepspeed(
    two_ranks: tuple[list[Any], list[Any]],
) -> None:
    ds, ours = two_ranks
    for rank in range(2):
        for case in CASES:
            mine, theirs = ours[rank][case], ds[rank][case]
            where = f"rank {rank} (stage, k, optimizer) = {case}"
            torch.testing.assert_close(
                torch.tensor(mine["losses"]), torch.tensor(theirs["losses"]), **LOSS_TOL,
                msg=f"{where}: losses",
            )  # fmt: skip
            torch.testing.assert_close(
                torch.tensor(mine["norms"]), torch.tensor(theirs["norms"]), **LATER_NORM_TOL,
                msg=f"{where}: clipping norms",
            )  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_moe_bf16_four_ranks_expert_data_2_matches_deepspeed(stage: int, tmp_path: Path) -> None:
    """4 ranks, ep 2: experts replicated over expert_data 2. The dense gradients are summed
    over 4 ranks in bf16 (DeepSpeed in its own bucket layout), so the norms agree to bf16
    reduction rounding (rtol 1e-2) rather than fp32's; the losses to the issue's 2e-3."""
    cases: list[Case] = [(stage, k, "client") for k in (1, 2)]
    ds, ours = _run_both(tmp_path, 4, cases)
    for rank in range(4):
        for case in cases:
            mine, theirs = ours[rank][case], ds[rank][case]
            where = f"rank {rank} (stage, k, optimizer) = {case}"
            if stage == 0:
                _check_deepspeed_rule(theirs, case[2], where)
            torch.testing.assert_close(
                torch.tensor(mine["losses"]), torch.tensor(theirs["losses"]), **LOSS_TOL,
                msg=f"{where}: losses",
            )  # fmt: skip
            torch.testing.assert_close(
                torch.tensor(mine["norms"]), torch.tensor(theirs["norms"]), rtol=1e-2,
                atol=0.0, msg=f"{where}: clipping norms",
            )  # fmt: skip
