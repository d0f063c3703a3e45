"""``benchmarks/compress_serve_bench.py`` end to end on a tiny Llama (seconds): layer
reduction + 8-bit / 4-bit weights + kv-group head pruning trained through
``shardspeed.initialize``, ``redundancy_clean``, ``save_pretrained``, and ``pipeline()``
serving the cleaned checkpoints with the cleaned model's own greedy tokens; the parameter
counts are what the ratios predict; one timing worker runs in process."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from shardspeed.testing import run_distributed

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
pytest.importorskip("transformers")


def _run_tiny(out: str) -> dict:
    sys.path.insert(0, str(BENCH))
    import compress_serve_bench as bench

    args = bench.parse_args(
        ["--size", "tiny", "--group-size", "32", "--steps", "2", "--check-tokens", "12",
         "--rounds", "0", "--new-tokens", "8"]
    )  # fmt: skip
    report = bench.build_checkpoints(args, Path(out))
    # one timing case, in process (the bench runs each in its own process)
    path, dtype, quant = bench.case_spec("clean-int4", {"clean4": Path(out) / "clean4"}, 32)
    result = Path(out) / "case.json"
    bench.worker(
        bench.parse_args(
            [
                "--worker",
                "--path",
                str(path),
                "--dtype",
                dtype,
                "--quant",
                json.dumps(quant),
                "--prompt-ids",
                json.dumps(report["prompt"]),
                "--new-tokens",
                "8",
                "--threads",
                "1",
                "--result",
                str(result),
            ]
        )  # fmt: skip
    )
    report["case"] = json.loads(result.read_text())
    return report


def test_tiny_compress_clean_serve(tmp_path):
    report = run_distributed(_run_tiny, 1, str(tmp_path))[0]
    sys.path.insert(0, str(BENCH))
    from compress_serve_bench import failed_checks

    assert failed_checks(report) == []
    assert report["teacher_layers"] == [1, 3]
    # teacher: 2 * 256 * 64 embeddings/head + 64 final norm + 4 layers of
    # (q, k, v, o: 64 * 8 * (2 * 8 + 2 * 2) + gate/up/down: 3 * 64 * 128 + 2 norms * 64)
    assert report["teacher_params"] == 32768 + 64 + 4 * (10240 + 24576 + 128)
    for bits in (8, 4):
        w = report["widths"][bits]
        # half the layers, one of two kv groups: q, o 4 heads and k, v 1 head of 8
        assert w["params"] == w["predicted_params"] == 32768 + 64 + 2 * (5120 + 24576 + 128)
        assert w["heads"] == [4, 1]
        assert w["fp32_equal"], "pipeline fp32 differs from the cleaned model's greedy tokens"
        assert w["int_fp32_compute_equal"], f"int{bits} (fp32 compute) differs"
        assert len(w["reference"]) == 12
    # every served weight is exactly the cleaned one (fp32 rounding of scale * q), o_proj
    # included: it lost half its input columns after its per-row int8 scales were fixed, so
    # rows whose largest level went with them are found on their grid from level 1
    assert max(report["widths"][4]["int_fp32_weight_diff"].values()) < 1e-6
    assert max(report["widths"][8]["int_fp32_weight_diff"].values()) < 1e-6
    # the timed case (bf16 + torch's int4 kernel) generated its tokens; its speed is the bench's
    assert len(report["case"]["tokens"]) == 8 and report["case"]["tok_s"] > 0
