"""The training benchmark's MFU column: FLOPs per token, the GPU peak table, the ratio."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

from trainbench.report import mfu, results_table  # noqa: E402
from trainbench.workload import PRESETS, Workload, flops_per_token, peak_tflops  # noqa: E402


def test_flops_per_token_of_the_1b_preset() -> None:
    wl = {**Workload().to_dict(), **PRESETS["1b"]}
    weights = 20 * 12 * 2048**2 + 50304 * 2048  # 1.11e9 matmul weights
    assert flops_per_token(wl) == 6 * weights + 12 * 20 * 2048 * 1024
    assert 1.0e9 < weights < 1.2e9  # "about 1B"


def test_peak_table() -> None:
    assert peak_tflops("NVIDIA H100 80GB HBM3") == pytest.approx(989.4)
    assert peak_tflops("NVIDIA H200") == pytest.approx(989.4)
    assert peak_tflops("Some Other GPU") is None


def test_mfu_divides_achieved_flops_by_every_devices_peak() -> None:
    wl = Workload().to_dict()
    tokens_per_s = 1e6 / flops_per_token(wl) * 4.0  # 4e6 FLOP/s achieved, whole launch
    row = {"workload": wl, "tokens_per_s": tokens_per_s}
    assert mfu(row, {"peak_tflops": 1e-6, "nproc": 2}) == "200.0%"  # 4 MFLOP/s over 2 x 1
    assert mfu(row, {"nproc": 2}) is None  # no peak known: no column


def test_results_table_has_an_mfu_column_only_with_a_peak() -> None:
    row = {
        "engine": "shardspeed", "stage": 0, "label": "shardspeed Z0", "status": "ok",
        "median_ms": 10.0, "p90_ms": 11.0, "min_ms": 9.0, "tokens_per_s": 1000.0,
        "peak_mem_mb_per_rank": [1.0], "peak_mem_delta_mb_per_rank": [0.5], "init_s": 0.1,
        "loss_step1": 5.0, "loss_final": 4.0, "workload": Workload().to_dict(),
    }  # fmt: skip
    assert "MFU" not in results_table([row], markdown=True)
    table = results_table([row], markdown=True, header={"peak_tflops": 1.0, "nproc": 1})
    assert "MFU" in table.splitlines()[0]
