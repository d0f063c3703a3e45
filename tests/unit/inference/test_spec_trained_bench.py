"""``benchmarks/spec_trained.py`` end to end at toy scale (seconds): BPE on a few stdlib
files, a tiny Llama target, a CE draft and a distilled draft trained and saved, then
re-measured from disk (``--skip-train``) through ``InferenceEngine.from_pretrained`` with
speculation; fp32 greedy outputs identical to the target alone (asserted by the bench)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[3] / "benchmarks"
pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

TOY = [
    "--max-files", "24", "--holdout-every", "4", "--vocab", "400",
    "--target-shape", "64,2,4,2,128", "--draft-shape", "32,1,2,1,64",
    "--target-steps", "12", "--draft-steps", "6", "--target-lr", "1e-2",
    "--seq", "32", "--batch", "2", "--threads", "1", "--eval-windows", "2",
    "--measure-threads", "1", "--dtypes", "float32", "--ks", "2", "--prompts", "2",
    "--prompt-len", "16", "--new-tokens", "8", "--rounds", "1",
]  # fmt: skip


def _bench():
    sys.path.insert(0, str(BENCH))
    import spec_trained

    return spec_trained


def test_train_then_measure_from_disk(tmp_path):
    bench = _bench()
    out = tmp_path / "models"
    bench.main([*TOY, "--out", str(out), "--train", "target,draft", "--skip-measure"])
    report_file = tmp_path / "report.json"
    bench.main([*TOY, "--out", str(out), "--train", "draft_distill", "--json", str(report_file),
                "--draft-quantization", "none,int8"])  # fmt: skip
    report = json.loads(report_file.read_text())
    train = json.loads((out / "train_report.json").read_text())
    assert set(train) == {"target", "draft", "draft_distill"}
    assert train["target"]["last10_loss"] < train["target"]["first_loss"]
    models = report["models"]
    assert set(models) == {"target", "draft", "draft_distill"}
    # per-token weights: all but the input embeddings; draft = 1 layer of hidden 32 + head
    assert models["draft"]["per_token_weights"] == 400 * 32 + 32 + (
        32 * (2 * 32 + 2 * 16) + 3 * 32 * 64 + 2 * 32
    )
    ratio = models["draft"]["per_token_weights"] / models["target"]["per_token_weights"]
    assert models["draft"]["weight_ratio"] == round(ratio, 3)
    assert all(math.isfinite(m["heldout_loss"]) for m in models.values())
    engines = [r["engine"] for r in report["rows"]]
    assert engines == ["target", "draft:k=2", "draft int8:k=2", "draft_distill:k=2",
                       "draft_distill int8:k=2", "draft alone", "draft_distill alone"]  # fmt: skip
    for row in report["rows"]:
        assert row["tok_s"] > 0
        if ":k=" in row["engine"]:
            assert row["identical"] == "2/2" and row["first_diff"] == []
            assert 0.0 <= row["acceptance"] <= 1.0
            assert 1.0 <= row["tokens_per_verify"] <= 1 + int(row["engine"][-1])


def test_unknown_model_name_refused(tmp_path):
    with pytest.raises(ValueError, match="--train target,drafty"):
        _bench().main([*TOY, "--out", str(tmp_path), "--train", "target,drafty"])
