"""benchmarks/cpu_gemm_bench.py runs end to end on the smallest shapes (where the kernel is)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from shardspeed.ops import cpu_gemm

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not cpu_gemm.available(), reason="the kernel is for AVX2 CPUs without AVX-512")
def test_bench_prints_a_row_per_shape() -> None:
    cmd = [sys.executable, str(REPO / "benchmarks" / "cpu_gemm_bench.py"), "--size", "31m",
           "--rows", "8", "--rounds", "1", "--pool", "1e6"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True).stdout
    rows = [line for line in out.splitlines() if line.startswith("| ") and "x" in line]
    assert len(rows) >= 5 and all(line.endswith("x |") for line in rows[1:]), out
