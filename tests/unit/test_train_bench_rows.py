"""The training benchmark's before/after rows (``--baseline-root``) and paired mode: row
planning, labels, the ratio table and the CPU column."""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

from train_bench import plan_rows  # noqa: E402
from trainbench.engines import BASELINE, row_label  # noqa: E402
from trainbench.paired import parse_rows, rows_arg  # noqa: E402
from trainbench.report import ratio_table, results_table  # noqa: E402
from trainbench.results import merge_rounds  # noqa: E402


def _row(engine: str, stage: int, ms: float, cpu: list[float] | None = None) -> dict:
    row = {
        "engine": engine,
        "stage": stage,
        "label": row_label(engine, stage),
        "status": "ok",
        "median_ms": ms,
        "p90_ms": ms,
        "min_ms": ms,
        "tokens_per_s": 1.0,
        "peak_mem_mb_per_rank": [100.0],
        "peak_mem_delta_mb_per_rank": [10.0],
        "init_s": 1.0,
        "loss_step1": 5.0,
        "loss_final": 4.0,
        "losses": [5.0, 4.0],
        "step_times_ms": [ms],
    }
    if cpu is not None:
        row["cpu_ms"] = cpu
    return row


def test_baseline_rows_follow_shardspeed() -> None:
    rows = plan_rows(["deepspeed", "shardspeed"], [0, 2], baseline=True)
    assert rows == [
        ("deepspeed", 0),
        ("shardspeed", 0),
        (BASELINE, 0),
        ("deepspeed", 2),
        ("shardspeed", 2),
        (BASELINE, 2),
    ]
    assert plan_rows(["deepspeed", "shardspeed"], [0]) == [("deepspeed", 0), ("shardspeed", 0)]
    assert row_label(BASELINE, 1) == "shardspeed@base Z1"


def test_ratio_table_pairs_baseline_with_peer_and_with_shardspeed() -> None:
    results = [_row("deepspeed", 0, 100.0), _row("shardspeed", 0, 80.0), _row(BASELINE, 0, 90.0)]
    table = ratio_table(results, markdown=True)
    assert "| shardspeed Z0 / DeepSpeed Z0 | 0.80 |" in table
    assert "| shardspeed@base Z0 / DeepSpeed Z0 | 0.90 |" in table
    assert "| shardspeed Z0 / shardspeed@base Z0 | 0.89 |" in table
    assert "CPU ratio" not in table


def test_paired_rows_carry_a_cpu_column_and_ratio() -> None:
    results = [_row("deepspeed", 0, 100.0, [50.0]), _row("shardspeed", 0, 80.0, [40.0])]
    assert "CPU ms" in results_table(results, markdown=True)
    table = ratio_table(results, markdown=True)
    assert "CPU ratio" in table and table.splitlines()[-1].endswith("| 0.80 |")


def test_merge_rounds_pools_cpu_times() -> None:
    rounds = [_row("shardspeed", 0, 80.0, [40.0]), _row("shardspeed", 0, 60.0, [30.0])]
    assert merge_rounds(rounds)["cpu_ms"] == [40.0, 30.0]


def test_paired_rows_argument_round_trips() -> None:
    rows = [("deepspeed", 0), ("shardspeed", 2)]
    assert [(r.engine, r.stage) for r in parse_rows(rows_arg(rows))] == rows
