"""Smoke test of ``benchmarks/tp_bench.py``: its AutoTP and Ulysses rows at a tiny size.

The fast tests run the rows' training code (``trainbench.tp_worker.train_parallel_row``) on
warm gloo ranks from ``shardspeed.testing`` instead of through ``torch.distributed.run``:

* the shardspeed AutoTP tp=2 row trains, shards the model, and its step-1 loss equals the
  unsharded Hugging Face Llama's loss on the same batch in one process;
* the Ulysses rows (full attention on 1 rank, shardspeed sp=2) train and agree on the loss
  at every step; the report prints the ratio table and the scaling line from them;
* the row plan and flag checks of the parent script.

Against DeepSpeed: the DeepSpeed rows' step-1 losses (AutoTP tp=2, Ulysses sp=2) are
recorded in ``tests/goldens/autotp/tp_bench_*.json`` and must equal our rows' (the golden
variant, run everywhere); the slow live variant runs the script end to end, DeepSpeed rows
included, where the peers venv has DeepSpeed (``tests/goldens/README.md``).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from goldens import deepspeed_oracle as golden

from shardspeed.testing import run_distributed

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
TINY = dict(n_layer=1, n_embd=32, n_head=4, n_kv_head=2, intermediate_size=48,
            block_size=32, vocab_size=64, micro_batch=2, steps=2, warmup=1)  # fmt: skip
RTOL = 1e-5


def _import_bench() -> None:
    """Make ``trainbench`` / ``tp_bench`` importable (they live in benchmarks/, not a package)."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))


def _row_body(kind: str, engine: str, degree: int) -> dict[str, Any]:
    _import_bench()
    from trainbench.llama import LlamaWorkload
    from trainbench.tp_worker import ParallelRow, train_parallel_row

    row = ParallelRow(kind, engine, degree)
    result = train_parallel_row(row, LlamaWorkload(**TINY), stage=1, device=torch.device("cpu"))
    return {**row.to_dict(), "label": row.label, "stage": 1, **result}


@functools.cache
def _row(kind: str, engine: str, degree: int) -> list[dict[str, Any]]:
    """Every rank's result of one row (once per session: several tests read it)."""
    return run_distributed(_row_body, degree, kind, engine, degree, timeout=150)


def test_autotp_row_trains_with_the_one_process_loss() -> None:
    pytest.importorskip("transformers")
    _import_bench()
    from trainbench.llama import LlamaWorkload, build_llama, hf_causal_lm_loss
    from trainbench.workload import make_batches

    ranks = _row("tp", "shardspeed", 2)
    ours = ranks[0]
    assert ours["status"] == "ok", ours
    assert "losses" not in ranks[1], "only rank 0 reports the row"
    assert len(ours["step_times_ms"]) == TINY["steps"]
    assert len(ours["peak_mem_mb_per_rank"]) == 2
    assert 0 < ours["engine_info"]["module_numel"] < ours["num_params"], "model not sharded"

    workload = LlamaWorkload(**TINY)
    x, y = make_batches(workload, 0, 1, torch.device("cpu"))[0]
    with torch.no_grad():
        expected = hf_causal_lm_loss(build_llama(workload), x, y).item()
    assert abs(ours["loss_step1"] - expected) <= RTOL * abs(expected), (ours["losses"], expected)


def test_ulysses_rows_agree_with_full_attention(capsys: pytest.CaptureFixture[str]) -> None:
    _import_bench()
    from trainbench.tp_report import print_tp_report

    full = _row("ulysses", "full", 1)[0]
    ours = _row("ulysses", "shardspeed", 2)[0]
    assert full["status"] == ours["status"] == "ok", (full, ours)
    assert ours["world_size"] == 2 and full["world_size"] == 1
    for step, (mine, ref) in enumerate(zip(ours["losses"], full["losses"])):
        assert abs(mine - ref) <= RTOL * abs(ref), (
            f"step {step}: {ours['losses']} vs {full['losses']}"
        )

    header = {"date": "-", "machine": "-", "device": "cpu", "nproc": "1,2", "threads_per_rank": 1,
              "torch_versions": [torch.__version__], "rounds": 1}  # fmt: skip
    print_tp_report(header, [full, ours], markdown=True)
    out = capsys.readouterr().out
    assert "| shardspeed Ulysses sp=2 / full attention, 1 rank |" in out, out
    assert "shardspeed Ulysses sp=2: " in out and "scaling efficiency" in out, out


def test_row_plan_and_flag_errors() -> None:
    _import_bench()
    import tp_bench

    labels = [r.label for r in tp_bench.plan_rows(tp_bench.parse_args(["--tp", "2,4"]))]
    assert labels == ["DeepSpeed AutoTP tp=2", "shardspeed AutoTP tp=2",
                      "DeepSpeed AutoTP tp=4", "shardspeed AutoTP tp=4"]  # fmt: skip
    args = tp_bench.parse_args(["--ulysses", "--engines", "shardspeed"])
    assert args.block_size >= 4096, "the Ulysses rows default to a long sequence"
    assert [(r.engine, r.nproc) for r in tp_bench.plan_rows(args)] == [
        ("full", 1),
        ("shardspeed", 2),
    ]
    for bad in (["--tp", "0"], ["--engines", "megatron"], ["--stage", "3"]):
        with pytest.raises(SystemExit, match=bad[0]):
            tp_bench.plan_rows(tp_bench.parse_args(bad))


def _tiny_flags() -> list[str]:
    return [x for k, v in TINY.items() for x in ("--" + k.replace("_", "-"), str(v))]


ROWS = {"tp": ["--tp", "2"], "sp": ["--ulysses", "--sp", "2"]}
OURS = {"tp": ("tp", "shardspeed", 2), "sp": ("ulysses", "shardspeed", 2)}


def _run_script(rows: list[str], tmp_path: Path) -> list[dict[str, Any]]:
    out = tmp_path / "result.json"
    cmd = [golden.live_python(), str(BENCH / "tp_bench.py"), *rows, *_tiny_flags()]
    cmd += ["--json-out", str(out), "--log-dir", str(tmp_path / "logs")]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    results = json.loads(out.read_text())["results"]
    assert all(r["status"] == "ok" for r in results), results
    first = [r["loss_step1"] for r in results]
    assert max(first) - min(first) <= RTOL * abs(first[0]), first
    return results


def _deepspeed_rows(which: str, tmp_path: Path) -> dict[str, Any]:
    """The script end to end (every row), DeepSpeed's rows kept for the golden."""
    results = _run_script(ROWS[which], tmp_path)
    keep = ("label", "losses", "loss_step1")
    return {"rows": [{k: r[k] for k in keep} for r in results if r["engine"] == "deepspeed"]}


# the live variant runs the whole script (DeepSpeed imports included): slow
SOURCES = [s if s == "golden" else pytest.param(s, marks=pytest.mark.slow)
           for s in golden.ORACLE_SOURCES]  # fmt: skip


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("which", list(ROWS))
def test_script_rows_match_deepspeed(source: str, which: str, tmp_path: Path) -> None:
    theirs = golden.deepspeed_side(
        source, "autotp", f"tp_bench_{which}.json", lambda: _deepspeed_rows(which, tmp_path)
    )["rows"]
    assert theirs, "no DeepSpeed row"
    ours = _row(*OURS[which])[0]
    for row in theirs:
        assert abs(ours["loss_step1"] - row["loss_step1"]) <= RTOL * abs(row["loss_step1"]), (
            f"{row['label']}: DeepSpeed {row['loss_step1']} vs ours {ours['loss_step1']}"
        )
