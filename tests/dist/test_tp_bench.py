"""Smoke test of ``benchmarks/tp_bench.py``: its AutoTP and Ulysses rows at a tiny size.

The fast tests run the rows' training code (``trainbench.tp_worker.train_parallel_row``) on
warm gloo ranks from ``shardspeed.testing`` instead of through ``torch.distributed.run``:

* the shardspeed AutoTP tp=2 row trains, shards the model, and its step-1 loss equals the
  unsharded Hugging Face Llama's loss on the same batch in one process;
* the Ulysses rows (full attention on 1 rank, shardspeed sp=2) train and agree on the loss
  at every step; the report prints the ratio table and the scaling line from them;
* the row plan and flag checks of the parent script.

The slow test runs the script end to end against DeepSpeed (needs ``.venv-peers``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from shardspeed.testing import run_distributed

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
PEERS_PYTHON = ROOT / ".venv-peers" / "bin" / "python"
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


def test_autotp_row_trains_with_the_one_process_loss() -> None:
    pytest.importorskip("transformers")
    _import_bench()
    from trainbench.llama import LlamaWorkload, build_llama, hf_causal_lm_loss
    from trainbench.workload import make_batches

    ranks = run_distributed(_row_body, 2, "tp", "shardspeed", 2, timeout=150)
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

    full = run_distributed(_row_body, 1, "ulysses", "full", 1, timeout=120)[0]
    ours = run_distributed(_row_body, 2, "ulysses", "shardspeed", 2, timeout=120)[0]
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


@pytest.mark.slow
@pytest.mark.skipif(not PEERS_PYTHON.exists(), reason="needs .venv-peers (make bench-peers)")
@pytest.mark.parametrize("rows", [["--tp", "2"], ["--ulysses", "--sp", "2"]], ids=["tp", "sp"])
def test_script_end_to_end_against_deepspeed(rows: list[str], tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    cmd = [str(PEERS_PYTHON), str(BENCH / "tp_bench.py"), *rows, *_tiny_flags()]
    cmd += ["--json-out", str(out), "--log-dir", str(tmp_path / "logs")]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    results = json.loads(out.read_text())["results"]
    assert all(r["status"] == "ok" for r in results), results
    first = [r["loss_step1"] for r in results]
    assert max(first) - min(first) <= RTOL * abs(first[0]), first
