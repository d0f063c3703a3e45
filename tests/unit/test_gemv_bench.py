"""benchmarks/gemv_bench.py: the model shapes and one tiny timing pass."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import gemv_bench  # noqa: E402

from shardspeed.ops import cpu_gemv  # noqa: E402


def test_shapes_are_the_fused_llama_linears() -> None:
    assert gemv_bench.shapes("200m") == {
        "qkv": (1536, 1024),
        "o": (1024, 1024),
        "gate_up": (5632, 1024),
        "down": (1024, 2816),
        "head": (32000, 1024),
    }


@pytest.mark.skipif(torch.float32 not in cpu_gemv.kernel_dtypes(), reason="no AVX-512")
def test_one_pass_reports_every_engine() -> None:
    res = gemv_bench.bench_shape(64, 96, torch.float32, [1, 8], rounds=1, cycle_bytes=1e5)
    assert set(res) == {1, 8}
    assert set(res[1]) == {"sum", "onednn", "gemv"} and set(res[8]) == {"sum", "onednn"}
    assert all(v > 0 for r in res.values() for v in r.values())
