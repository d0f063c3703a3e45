"""Parent-side pieces shared by ``train_bench.py`` and ``tp_bench.py``.

Both scripts launch every row as its own ``torch.distributed.run`` child, interleave the
rows over ``--rounds``, describe the machine in a header and can save everything as JSON.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import subprocess
import sys
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from _bench_common import (
    REPO_ROOT,
    child_env,
    machine_description,
    probe_python,
    run_child,
    torch_version,
)

from trainbench.workload import Workload

Row = TypeVar("Row", bound=Hashable)

# DeepSpeed JIT-compiles C++ ops on first use and caches them under ~/.cache/torch_extensions
# (TORCH_EXTENSIONS_DIR). On CPU its comm backend builds "deepspeed_shm_comm" inside
# deepspeed.initialize (~70-90 s on 2 cores), and FusedAdam is a C++ op too. Building them
# once before the timed launches keeps compile time out of the rows' init time.
DS_PREWARM = """
import time
from deepspeed.accelerator import get_accelerator
start = time.perf_counter()
for name in {names!r}:
    builder = get_accelerator().create_op_builder(name)
    if builder is not None and builder.is_compatible():
        builder.load(verbose=False)
print(f"{{time.perf_counter() - start:.1f}}")
"""


def prewarm_deepspeed(peers: str, ds_optimizer: str, timeout: float) -> None:
    """Build (or load from cache) the DeepSpeed JIT ops the rows will use, untimed."""
    names = ["ShareMemCommBuilder"]
    if ds_optimizer == "native":
        names.append("FusedAdamBuilder")
    print(f"building/loading DeepSpeed JIT ops {names} (cached after the first time) ...")
    ok, line = probe_python(peers, DS_PREWARM.format(names=names), timeout=timeout)
    print(f"  {'done in ' + line + ' s' if ok else 'FAILED: ' + line}")


def workload_argv(workload: Workload) -> list[str]:
    """``workload`` as the command-line flags a child parses back (``--n-layer 4 ...``)."""
    out: list[str] = []
    for name, value in workload.to_dict().items():
        out += ["--" + name.replace("_", "-"), str(value)]
    return out


def launch_child(
    cmd: list[str],
    args: argparse.Namespace,
    log: Path,
    base: dict[str, Any],
    import_root: Path | None = None,
) -> dict[str, Any]:
    """Run one ``torch.distributed.run`` launch; its result (or the failure) on top of ``base``.

    ``import_root``: another checkout whose ``shardspeed`` the child imports (put first on
    its ``PYTHONPATH``); the worker and the workload stay this checkout's. The result keeps
    ``base``'s ``engine`` and ``label`` (the worker only knows it ran "shardspeed").
    """
    env = child_env(args.threads, args.device)
    if import_root is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(import_root), env["PYTHONPATH"]])
    code, results, tail = run_child(cmd, env, args.timeout, log)
    base = {**base, "log": str(log)}
    if results:
        names = {k: base[k] for k in ("engine", "label") if k in base and import_root is not None}
        return {**base, **results[-1], **names}
    return {**base, "status": "error", "error": f"exit code {code}; log {log}\n{tail}"}


def bench_header(
    args: argparse.Namespace, nproc: int | str, torch_python: str, peers: str | None
) -> dict[str, Any]:
    """Machine, interpreters, torch builds and the command line of one benchmark run."""
    return {
        "date": _dt.date.today().isoformat(),
        "loadavg_start": list(os.getloadavg()),
        "machine": machine_description(),
        "device": args.device,
        "nproc": nproc,
        "threads_per_rank": args.threads,
        "rounds": args.rounds,
        "command": " ".join([os.path.relpath(sys.executable, REPO_ROOT), *sys.argv]),
        "torch_python": torch_python,
        "peers_python": peers,
        "torch_versions": sorted(
            {torch_version(p) for p in {torch_python, peers} if p is not None}
        ),
        **_accelerator(args),
        **_baseline(args),
        **({"paired": True} if getattr(args, "paired", False) else {}),
    }


def _baseline(args: argparse.Namespace) -> dict[str, Any]:
    """The other checkout the ``shardspeed@base`` rows import, and its commit if it has one."""
    root = getattr(args, "baseline_root", None)
    if root is None:
        return {}
    head = subprocess.run(
        ["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    return {"baseline_root": str(root), "baseline_commit": head.stdout.strip() or None}


def _accelerator(args: argparse.Namespace) -> dict[str, Any]:
    """The GPU's name and the per-device peak the MFU column divides by: ``--peak-tflops``
    (any device, a CPU too) or, on CUDA, the known-GPU table."""
    given = getattr(args, "peak_tflops", None)
    if getattr(args, "device", "cpu") != "cuda":
        return {"peak_tflops": given} if given else {}
    import torch

    from trainbench.workload import peak_tflops

    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "unknown GPU"
    return {"gpu": name, "peak_tflops": given or peak_tflops(name)}


def run_interleaved(
    rows: Sequence[Row], rounds: int, launch: Callable[[Row], dict[str, Any]], desc: str
) -> dict[Row, list[dict[str, Any]]]:
    """Launch every row ``rounds`` times, one round of all rows after another."""
    from tqdm import tqdm

    runs: dict[Row, list[dict[str, Any]]] = {row: [] for row in rows}
    launches = [row for _ in range(rounds) for row in rows]
    for row in tqdm(launches, desc=desc, unit="launch", file=sys.stderr):
        runs[row].append(launch(row))
    return runs


def reprint_json(path: Path, print_report: Callable[..., None], markdown: bool) -> int:
    """Print the report of a ``--json-out`` file again (``--from-json``); exit code 0."""
    saved = json.loads(path.read_text())
    print_report(saved["header"], saved["results"], markdown=markdown)
    return 0


def write_json(path: Path, header: dict[str, Any], results: list[dict[str, Any]]) -> None:
    """Save the header and every row (``--from-json`` re-prints the report from it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"header": header, "results": results}, indent=2))
    print(f"wrote {path}")
