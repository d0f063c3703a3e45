"""Tensor-parallel and Ulysses training benchmark: DeepSpeed and shardspeed side by side.

TP rows (default): one small Hugging Face Llama (GQA) trained with AutoTP
(``"tensor_parallel": {"autotp_size": tp}``, ZeRO ``--stage``, fp32, torch AdamW) by
DeepSpeed and by shardspeed from the same ds_config, weights and tokens, at each ``--tp``
degree on ``tp`` ranks (so data-parallel degree 1: every rank sees the same batch).

Ulysses rows (``--ulysses``): a long-sequence decoder (default T=4096) trained with its
attention wrapped in DeepSpeed's and in shardspeed's ``DistributedAttention`` on ``--sp``
ranks, against the same model with full attention on one rank.

Each row is one ``torch.distributed.run`` launch on gloo; ``--rounds`` interleaves them.
Step time is the slowest rank's, memory is each rank's peak RSS; the step-1 losses of
rows that train the same model must agree (printed in the ratio table).

Usage:
    .venv-peers/bin/python benchmarks/tp_bench.py --tp 2,4 --rounds 3
    .venv-peers/bin/python benchmarks/tp_bench.py --ulysses --sp 2 --rounds 2
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench_common import REPO_ROOT, default_python, peers_python  # noqa: E402
from trainbench import launch  # noqa: E402
from trainbench.llama import LlamaWorkload, add_llama_args  # noqa: E402
from trainbench.results import merge_rounds  # noqa: E402
from trainbench.tp_report import print_tp_report  # noqa: E402
from trainbench.tp_worker import ParallelRow, tp_worker_main  # noqa: E402

TP_ENGINES = ("deepspeed", "shardspeed")
# TP rows: a Llama whose tp=2 step takes a few hundred ms on one core per rank (0.6-1.0 s
# on the busy 2-core dev box). 4 KV heads, so tp=4 gives every rank one: shardspeed refuses
# a split that leaves a rank without KV heads (DeepSpeed 0.19.8 runs it with empty shards).
TP_DEFAULTS = LlamaWorkload(
    n_layer=4,
    n_embd=512,
    n_head=8,
    n_kv_head=4,
    intermediate_size=1408,
    block_size=256,
    vocab_size=4096,
    micro_batch=2,
)
# Ulysses rows: one 4096-token sequence through two small GQA layers.
ULYSSES_DEFAULTS = LlamaWorkload(
    n_layer=2,
    n_embd=256,
    n_head=8,
    n_kv_head=2,
    intermediate_size=704,
    block_size=4096,
    vocab_size=512,
    micro_batch=1,
    steps=6,
    warmup=2,
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", default="2,4", help="comma-separated tensor-parallel degrees")
    p.add_argument(
        "--ulysses", action="store_true", help="run the Ulysses rows instead of the TP rows"
    )
    p.add_argument("--sp", default="2", help="comma-separated sequence-parallel degrees")
    p.add_argument(
        "--engines",
        default=",".join(TP_ENGINES),
        help=f"comma-separated subset of {','.join(TP_ENGINES)}",
    )
    p.add_argument("--stage", type=int, default=1, help="ZeRO stage of the TP rows (0-2)")
    p.add_argument("--no-full", action="store_true", help="Ulysses: skip the one-rank row")
    p.add_argument("--device", choices=["cpu"], default="cpu")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each rank")
    p.add_argument("--python", default=None, help="interpreter for shardspeed / full rows")
    p.add_argument("--peers-python", default=None, help="interpreter with deepspeed installed")
    p.add_argument("--rounds", type=int, default=1, help="launch every row this many times")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per launch")
    p.add_argument("--json-out", type=Path, default=None, help="write every result here")
    p.add_argument("--log-dir", type=Path, default=REPO_ROOT / "runs" / "tp_bench")
    p.add_argument("--markdown", action="store_true", help="print tables as markdown")
    p.add_argument("--from-json", type=Path, default=None, help="re-print a --json-out file")
    known, _ = p.parse_known_args(argv)
    add_llama_args(p, ULYSSES_DEFAULTS if known.ulysses else TP_DEFAULTS)
    # Child mode (set by the parent when it launches torch.distributed.run).
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--kind", default="tp", help=argparse.SUPPRESS)
    p.add_argument("--engine", default=None, help=argparse.SUPPRESS)
    p.add_argument("--degree", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.dtype is None:
        args.dtype = "fp32"
    return args


def _int_list(flag: str, text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise SystemExit(f"{flag}={text!r}: give comma-separated positive integers, e.g. 2,4")
    return values


def plan_rows(args: argparse.Namespace) -> list[ParallelRow]:
    """Launches in table order: per degree, DeepSpeed then shardspeed (full attention first)."""
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    bad = [e for e in engines if e not in TP_ENGINES]
    if bad:
        raise SystemExit(f"--engines: unknown {bad}; choose from {','.join(TP_ENGINES)}")
    if not args.ulysses:
        if args.stage not in (0, 1, 2):
            raise SystemExit(f"--stage={args.stage}: AutoTP rows run ZeRO 0, 1 or 2")
        return [ParallelRow("tp", e, tp) for tp in _int_list("--tp", args.tp) for e in engines]
    rows = [] if args.no_full else [ParallelRow("ulysses", "full", 1)]
    return rows + [
        ParallelRow("ulysses", e, sp) for sp in _int_list("--sp", args.sp) for e in engines
    ]


def launch_row(args: argparse.Namespace, row: ParallelRow, python: str) -> dict[str, Any]:
    """Run one launch of ``row`` and return its result object."""
    cmd = [python, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={row.nproc}"]
    cmd += [str(Path(__file__).resolve()), "--worker", "--kind", row.kind, "--engine", row.engine]
    cmd += ["--degree", str(row.degree), "--stage", str(args.stage), "--device", args.device]
    cmd += launch.workload_argv(LlamaWorkload.from_args(args))
    if args.ulysses:
        cmd.append("--ulysses")
    log = args.log_dir / f"{row.kind}_{row.engine}_{row.degree}.log"
    return launch.launch_child(
        cmd, args, log, {**row.to_dict(), "label": row.label, "nproc": row.nproc}
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return tp_worker_main(args)
    if args.from_json is not None:
        return launch.reprint_json(args.from_json, print_tp_report, args.markdown)
    if args.rounds < 1 or args.steps < 1 or args.warmup < 0:
        raise SystemExit("--rounds and --steps must be >= 1 and --warmup >= 0")
    rows = plan_rows(args)
    torch_python = args.python or default_python()
    peers = args.peers_python or (str(peers_python()) if peers_python() else None)
    skipped = {row for row in rows if row.engine == "deepspeed" and peers is None}
    if skipped:
        print("deepspeed rows skipped: .venv-peers missing (run `make bench-peers`)")
    elif any(row.engine == "deepspeed" for row in rows):
        launch.prewarm_deepspeed(peers, args.ds_optimizer, args.timeout)

    nproc = ",".join(sorted({str(row.nproc) for row in rows}, key=int))
    header = launch.bench_header(args, nproc, torch_python, peers)
    busiest = max(row.nproc for row in rows) * args.threads
    if busiest > (os.cpu_count() or 1):
        header["oversubscribed"] = f"{busiest} busy threads on {os.cpu_count()} cores"
    ran = [row for row in rows if row not in skipped]

    def launch_one(row: ParallelRow) -> dict[str, Any]:
        return launch_row(args, row, peers if row.engine == "deepspeed" else torch_python)

    runs = launch.run_interleaved(ran, args.rounds, launch_one, desc="tp_bench")
    header["loadavg_end"] = list(os.getloadavg())
    results = [merge_rounds(runs[row]) if row in runs else _skipped(row) for row in rows]
    print_tp_report(header, results, markdown=args.markdown)
    if args.json_out is not None:
        launch.write_json(args.json_out, header, results)
    return 0 if all(r["status"] in ("ok", "unavailable") for r in results) else 1


def _skipped(row: ParallelRow) -> dict[str, Any]:
    why = "deepspeed: .venv-peers missing (run `make bench-peers`)"
    return {**row.to_dict(), "label": row.label, "status": "unavailable", "error": why}


if __name__ == "__main__":
    sys.exit(main())
