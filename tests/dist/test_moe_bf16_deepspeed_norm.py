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
``slow``. DeepSpeed's results are recorded in ``tests/goldens/moe/`` (the golden variant,
run everywhere); the live variant runs where the peers venv has DeepSpeed
(``tests/goldens/README.md``).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from goldens import deepspeed_oracle as golden
from moe_bf16_oracle_worker import Case, parse_case, shardspeed_rank

from shardspeed.testing import run_distributed

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("moe_bf16_oracle_worker.py")
LOSS_TOL = {"rtol": 0.0, "atol": 2e-3}  # the bar for per-step losses
NORM_TOL = {"rtol": 1e-5, "atol": 0.0}  # same bf16 gradients, norms summed in fp32
# after an update: DeepSpeed's FusedAdam and torch's Adam may round a bf16 parameter apart
LATER_NORM_TOL = {"rtol": 1e-3, "atol": 0.0}
CASES: list[Case] = [(0, k, opt) for k in (1, 2) for opt in ("client", "config")]


def _case_text(case: Case) -> str:
    return ":".join(map(str, case))


def _deepspeed_live(result_dir: Path, world: int, cases: list[Case]) -> dict[str, Any]:
    cmd = [golden.live_python(), "-m", "torch.distributed.run", "--standalone"]
    cmd += ["--nproc_per_node", str(world), str(WORKER), str(result_dir)]
    cmd += [_case_text(case) for case in cases]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    ranks = [torch.load(result_dir / f"rank{r}.pt") for r in range(world)]
    return {"ranks": [{_case_text(c): v for c, v in rank.items()} for rank in ranks]}


def _deepspeed(source: str, result_dir: Path, world: int, cases: list[Case]) -> list[Any]:
    """DeepSpeed's results per rank: recorded (``source="golden"``) or run live."""
    name = f"bf16_norm_world{world}_" + "_".join(_case_text(c).replace(":", "-") for c in cases)
    theirs = golden.deepspeed_side(
        source, "moe", f"{name}.json", lambda: _deepspeed_live(result_dir, world, cases)
    )
    return [{parse_case(c): v for c, v in rank.items()} for rank in theirs["ranks"]]


@pytest.fixture(scope="module")
def two_ranks_ours() -> list[Any]:
    """ShardSpeed's results per rank (once: both variants compare with them)."""
    return run_distributed(shardspeed_rank, 2, CASES, timeout=300)


@pytest.fixture(scope="module", params=golden.ORACLE_SOURCES)
def two_ranks(
    request: pytest.FixtureRequest,
    two_ranks_ours: list[Any],
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[list[Any], list[Any]]:
    """(DeepSpeed's, ShardSpeed's) results per rank."""
    result_dir = tmp_path_factory.mktemp("moe_bf16_ds")
    return _deepspeed(request.param, result_dir, 2, CASES), two_ranks_ours


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
@pytest.mark.parametrize("source", golden.ORACLE_SOURCES)
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_moe_bf16_four_ranks_expert_data_2_matches_deepspeed(
    source: str, stage: int, tmp_path: Path
) -> None:
    """4 ranks, ep 2: experts replicated over expert_data 2. The dense gradients are summed
    over 4 ranks in bf16 (DeepSpeed in its own bucket layout), so the norms agree to bf16
    reduction rounding (rtol 1e-2) rather than fp32's; the losses to the issue's 2e-3."""
    cases: list[Case] = [(stage, k, "client") for k in (1, 2)]
    ds = _deepspeed(source, tmp_path, 4, cases)
    ours = run_distributed(shardspeed_rank, 4, cases, timeout=300)
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
