"""Side-by-side training benchmark: one GPT workload through shardspeed and its peers.

Rows (one ``torch.distributed.run`` launch each, run one after another):

- torch: DDP (stage-0 peer), FSDP2 ``fully_shard`` with ``reshard_after_forward=False``
  (stage-2 peer) and ``True`` (stage-3 peer);
- deepspeed: ZeRO stages 0-3 (needs ``.venv-peers``: ``make bench-peers``);
- shardspeed: ZeRO stages 0-3 through ``shardspeed.initialize`` and the same ds_config.

Every row trains the same model (same seed), on the same token stream, with the same AdamW
hyper-parameters and gradient clipping 1.0. The loss at step 1 must agree across rows; the
script prints the largest difference as a check that the workloads are identical.

``--baseline-root DIR`` adds a row per stage that runs shardspeed from another checkout
(``shardspeed@base``, e.g. a ``git worktree`` of the last commit) in the same interleaved
rounds, so a change is measured before/after under the same load, with both ratios to
DeepSpeed and their ratio to each other.

Usage:
    .venv-peers/bin/python benchmarks/train_bench.py --steps 10 --warmup 3
    python benchmarks/train_bench.py --engines torch,shardspeed --stages 0,3 --json-out r.json
    git worktree add /tmp/ss-main HEAD && .venv-peers/bin/python benchmarks/train_bench.py \
        --preset 21m --engines deepspeed,shardspeed --stages 0 --baseline-root /tmp/ss-main
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench_common import (  # noqa: E402
    REPO_ROOT,
    default_python,
    peers_python,
    probe_python,
)
from trainbench.launch import (  # noqa: E402
    bench_header,
    launch_child,
    prewarm_deepspeed,
    reprint_json,
    run_interleaved,
    workload_argv,
    write_json,
)
from trainbench.report import print_report  # noqa: E402
from trainbench.results import merge_rounds  # noqa: E402
from trainbench.workload import PRESETS, Workload, add_workload_args  # noqa: E402

ENGINE_GROUPS = ("torch", "deepspeed", "shardspeed")
SHARDSPEED_PROBE = "import shardspeed; shardspeed.initialize; print('ok')"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--engines",
        default="torch,deepspeed,shardspeed",
        help=f"comma-separated subset of {','.join(ENGINE_GROUPS)}",
    )
    p.add_argument("--stages", default="0,1,2,3", help="comma-separated ZeRO stages")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="dense bf16 peak of one GPU for the MFU column (default: H100/H200 989.4, "
        "A100 312; other GPUs show no MFU unless given)",
    )
    p.add_argument(
        "--nproc", type=int, default=None, help="ranks per launch (default: 2 on CPU, all GPUs)"
    )
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each rank")
    p.add_argument("--python", default=None, help="interpreter for torch/shardspeed rows")
    p.add_argument("--peers-python", default=None, help="interpreter with deepspeed installed")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="launch every row this many times, interleaved; step times are pooled",
    )
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per launch")
    p.add_argument(
        "--baseline-root",
        type=Path,
        default=None,
        help="another shardspeed checkout: its rows (shardspeed@base) run beside this one's",
    )
    p.add_argument(
        "--paired",
        action="store_true",
        help="one launch per round running every row, stepped in turn (robust to a "
        "changing load; no memory columns): see trainbench/paired.py",
    )
    p.add_argument("--json-out", type=Path, default=None, help="write every result here")
    p.add_argument("--log-dir", type=Path, default=REPO_ROOT / "runs" / "train_bench")
    p.add_argument("--markdown", action="store_true", help="print tables as markdown")
    p.add_argument(
        "--from-json", type=Path, default=None, help="re-print the report of a --json-out file"
    )
    add_workload_args(p)
    # Child mode (set by the parent when it launches torch.distributed.run).
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--engine", default=None, help=argparse.SUPPRESS)
    p.add_argument("--stage", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--paired-rows", default=None, help=argparse.SUPPRESS)
    known, _ = p.parse_known_args(argv)
    if known.preset:
        p.set_defaults(**PRESETS[known.preset])
    args = p.parse_args(argv)
    if args.device == "auto":
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.dtype is None:
        args.dtype = "bf16" if args.device == "cuda" else "fp32"
    return args


def plan_rows(
    engines: list[str], stages: list[int], baseline: bool = False
) -> list[tuple[str, int]]:
    """(engine, stage) launches in table order: per stage, torch peer, DeepSpeed, shardspeed
    (and, with ``baseline``, shardspeed from the baseline checkout)."""
    from trainbench.engines import BASELINE, TORCH_STAGE_ENGINES

    rows: list[tuple[str, int]] = []
    for stage in stages:
        if "torch" in engines and stage in TORCH_STAGE_ENGINES:
            rows.append((TORCH_STAGE_ENGINES[stage][0], stage))
        if "deepspeed" in engines:
            rows.append(("deepspeed", stage))
        if "shardspeed" in engines:
            rows.append(("shardspeed", stage))
            if baseline:
                rows.append((BASELINE, stage))
    return rows


def launch_row(
    args: argparse.Namespace, engine: str, stage: int, python: str, nproc: int
) -> dict[str, Any]:
    """Run one (engine, stage) launch and return its result object."""
    from trainbench.engines import BASELINE, row_label

    root = args.baseline_root if engine == BASELINE else None
    worker_engine = "shardspeed" if engine == BASELINE else engine
    cmd = [python, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    cmd += [str(Path(__file__).resolve()), "--worker", "--engine", worker_engine]
    cmd += ["--stage", str(stage), "--device", args.device]
    cmd += workload_argv(Workload.from_args(args))
    log = args.log_dir / f"{engine.replace('@', '_')}_z{stage}.log"
    base = {"engine": engine, "stage": stage, "label": row_label(engine, stage)}
    return launch_child(cmd, args, log, base, import_root=root)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker and args.paired_rows:
        from trainbench.paired import paired_worker_main

        return paired_worker_main(args)
    if args.worker:
        from trainbench.worker import worker_main

        return worker_main(args)
    if args.from_json is not None:
        return reprint_json(args.from_json, print_report, args.markdown)

    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    bad = [e for e in engines if e not in ENGINE_GROUPS]
    if bad:
        raise SystemExit(f"--engines: unknown {bad}; choose from {','.join(ENGINE_GROUPS)}")
    stages = [int(s) for s in args.stages.split(",") if s.strip()]
    if any(s not in (0, 1, 2, 3) for s in stages):
        raise SystemExit(f"--stages={args.stages!r}: stages must be in 0,1,2,3")
    if args.paired and args.baseline_root is not None:
        raise SystemExit(
            "--paired runs every row in one process, which cannot import two shardspeed "
            "checkouts; drop --baseline-root or --paired"
        )
    if args.rounds < 1 or args.steps < 1 or args.warmup < 0:
        raise SystemExit("--rounds and --steps must be >= 1 and --warmup >= 0")
    nproc = args.nproc or (2 if args.device == "cpu" else _cuda_count())
    torch_python = args.python or default_python()
    peers = args.peers_python or (str(peers_python()) if peers_python() else None)

    skip: dict[str, str] = {}
    if args.baseline_root is not None and not (args.baseline_root / "shardspeed").is_dir():
        raise SystemExit(
            f"--baseline-root {args.baseline_root}: no shardspeed/ package there; give the "
            "root of another checkout (e.g. `git worktree add /tmp/ss-main HEAD`)"
        )
    if "deepspeed" in engines and peers is None:
        skip["deepspeed"] = "deepspeed: .venv-peers missing (run `make bench-peers`)"
    if "shardspeed" in engines:
        ok, line = probe_python(torch_python, SHARDSPEED_PROBE)
        if not ok:
            skip["shardspeed"] = "shardspeed: not available yet"
            print(f"shardspeed: not available yet ({line})")

    if "deepspeed" in engines and "deepspeed" not in skip:
        prewarm_deepspeed(peers, args.ds_optimizer, args.timeout)

    header = bench_header(args, nproc, torch_python, peers)
    rows = plan_rows(engines, stages, baseline=args.baseline_root is not None)

    def launch(row: tuple[str, int]) -> dict[str, Any]:
        python = peers if row[0] == "deepspeed" else torch_python
        return launch_row(args, row[0], row[1], python, nproc)

    ran = [row for row in rows if row[0] not in skip]
    if args.paired:
        from trainbench.paired import launch_paired

        python = peers if any(r[0] == "deepspeed" for r in ran) else torch_python
        runs = launch_paired(args, ran, python, nproc, str(Path(__file__).resolve()))
    else:
        runs = run_interleaved(ran, args.rounds, launch, desc="train_bench")
    header["loadavg_end"] = list(os.getloadavg())
    results = [
        merge_rounds(runs[row]) if runs.get(row) else _unavailable(*row, skip[row[0]])
        for row in rows
    ]

    print_report(header, results, markdown=args.markdown)
    if args.json_out is not None:
        write_json(args.json_out, header, results)
    return 0 if all(r["status"] in ("ok", "unavailable") for r in results) else 1


def _unavailable(engine: str, stage: int, why: str) -> dict[str, Any]:
    from trainbench.engines import row_label

    label = row_label(engine, stage)
    return {"engine": engine, "stage": stage, "label": label, "status": "unavailable", "error": why}


def _cuda_count() -> int:
    import torch

    return max(torch.cuda.device_count(), 1)


if __name__ == "__main__":
    sys.exit(main())
