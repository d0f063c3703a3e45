"""Helpers shared by the benchmark scripts: interpreters, child processes, stats, tables.

Benchmarks run each measured configuration in its own child process so that peak memory
and library imports of one row never leak into another. A child reports by printing one
line that starts with :data:`RESULT_MARKER` followed by a JSON object; the parent scans the
child's stdout for that line and ignores everything else (DeepSpeed logs a lot).
"""

from __future__ import annotations

import json
import os
import platform
import resource
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
BENCH_DIR = Path(__file__).resolve().parent
RESULT_MARKER = "SHARDSPEED_BENCH_RESULT "
PEERS_PYTHON = REPO_ROOT / ".venv-peers" / "bin" / "python"
MAIN_PYTHON = REPO_ROOT / ".venv" / "bin" / "python"


# ----------------------------------------------------------------------------- interpreters


def peers_python() -> Path | None:
    """The interpreter of ``.venv-peers`` (``make bench-peers``), or None if it is not built."""
    return PEERS_PYTHON if PEERS_PYTHON.exists() else None


def default_python() -> str:
    """The interpreter for rows that need only torch (and shardspeed).

    ``.venv-peers`` is preferred when it exists so every row of one table runs on the same
    torch build; otherwise the interpreter running this script.
    """
    peers = peers_python()
    return str(peers) if peers is not None else sys.executable


def probe_python(python: str, code: str, timeout: float = 120.0) -> tuple[bool, str]:
    """Run ``code`` with ``python``; return (succeeded, last line of output)."""
    try:
        proc = subprocess.run(
            [python, "-c", code],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=REPO_ROOT,
            env=child_env(threads=1, device="cpu"),
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, repr(exc)
    out = (proc.stdout + proc.stderr).strip().splitlines()
    return proc.returncode == 0, out[-1] if out else ""


def torch_version(python: str) -> str:
    ok, line = probe_python(python, "import torch; print(torch.__version__)")
    return line if ok else "unavailable"


# ----------------------------------------------------------------------------- child processes


def child_env(threads: int, device: str) -> dict[str, str]:
    """Environment for a benchmark child.

    - ``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS``: pin intra-op threads (the machine is shared).
    - ``DS_ACCELERATOR=cpu``: DeepSpeed otherwise probes for CUDA/XPU/NPU and logs a warning
      before falling back to its CPU accelerator.
    - ``PYTHONPATH``: the repository root, so ``import shardspeed`` resolves to this checkout
      even from an interpreter where it is not installed editable.
    """
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(threads)
    env["MKL_NUM_THREADS"] = str(threads)
    env["PYTHONUNBUFFERED"] = "1"
    env["TOKENIZERS_PARALLELISM"] = "false"
    if device == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
        env.setdefault("CUDA_VISIBLE_DEVICES", "")
    else:
        env.setdefault("DS_ACCELERATOR", "cuda")
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO_ROOT), str(BENCH_DIR), env.get("PYTHONPATH", "")) if p
    )
    return env


def emit_result(payload: dict[str, Any]) -> None:
    """Print one result line for the parent (call it on one rank only)."""
    print(RESULT_MARKER + json.dumps(payload, sort_keys=True), flush=True)


def parse_results(stdout: str) -> list[dict[str, Any]]:
    """All result objects a child printed, in order."""
    results = []
    for line in stdout.splitlines():
        idx = line.find(RESULT_MARKER)
        if idx >= 0:
            results.append(json.loads(line[idx + len(RESULT_MARKER) :]))
    return results


def run_child(
    cmd: Sequence[str], env: dict[str, str], timeout: float, log_path: Path | None
) -> tuple[int, list[dict[str, Any]], str]:
    """Run one child to completion; return (exit code, result objects, output tail)."""
    try:
        proc = subprocess.run(
            list(cmd), capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=timeout
        )
        code, out, err = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as exc:
        code = 124
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        err = exc.stderr.decode() if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        err += f"\n[timed out after {timeout:.0f} s]"
    if log_path is not None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_path.write_text(f"$ {' '.join(cmd)}\n--- stdout\n{out}\n--- stderr\n{err}\n")
    tail = "\n".join((out + "\n" + err).strip().splitlines()[-25:])
    return code, parse_results(out), tail


# ----------------------------------------------------------------------------- measurements


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile, ``q`` in [0, 100]."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo, hi = int(pos), min(int(pos) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize_times(times_s: Sequence[float]) -> dict[str, float]:
    """Median / p90 / mean / min of a list of step times, in milliseconds."""
    ms = [t * 1e3 for t in times_s]
    return {
        "median_ms": statistics.median(ms) if ms else float("nan"),
        "p90_ms": percentile(ms, 90),
        "mean_ms": statistics.fmean(ms) if ms else float("nan"),
        "min_ms": min(ms) if ms else float("nan"),
    }


def current_rss_mb() -> float:
    """Resident set size of this process now, in MiB."""
    try:
        import psutil

        return psutil.Process().memory_info().rss / 2**20
    except ImportError:
        return peak_rss_mb()


def peak_rss_mb() -> float:
    """Lifetime peak resident set size of this process (``ru_maxrss``), in MiB."""
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    return maxrss / 2**20 if sys.platform == "darwin" else maxrss / 2**10


def machine_description(cpuinfo: str | None = None) -> str:
    """One line naming the CPU, core count and the matrix ISA (used in table headers and the
    docs). Virtual machines often report a bare ``model name`` ("AMD EPYC"), so the x86
    family / model numbers and the AVX-512 / bf16 / AMX flags are added: they say which
    kernels the CPU runs (``cpuinfo``: ``/proc/cpuinfo``'s text, read when None)."""
    cpu = platform.processor() or platform.machine()
    fields: dict[str, str] = {}
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            if fields:  # the first processor's block is enough
                break
            continue
        fields.setdefault(key.strip(), value.strip())
    cpu = fields.get("model name", cpu)
    details = []
    if "cpu family" in fields and "model" in fields:
        details.append(f"family {fields['cpu family']} model {fields['model']}")
    flags = set(fields.get("flags", "").split())
    isa = [name for flag, name in (("avx512f", "AVX-512"), ("avx512_bf16", "bf16"),
           ("amx_bf16", "AMX-bf16"), ("amx_int8", "AMX-int8")) if flag in flags]  # fmt: skip
    if flags:
        details.append(" + ".join(isa) if isa else "no AVX-512")
    suffix = f" ({'; '.join(details)})" if details else ""
    return f"{os.cpu_count()}-core {cpu}{suffix}, {platform.system()} {platform.release()}"


# ----------------------------------------------------------------------------- tables


def fmt(value: Any, digits: int = 2) -> str:
    """Format a table cell: floats with ``digits`` decimals, None/NaN as ``-``."""
    if value is None:
        return "-"
    if isinstance(value, float):
        if value != value:  # NaN
            return "-"
        return f"{value:.{digits}f}"
    return str(value)


def render_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], markdown: bool) -> str:
    """A plain-text (aligned) or GitHub-markdown table."""
    cells = [[fmt(c) for c in row] for row in rows]
    if markdown:
        lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in cells]
        return "\n".join(lines)
    widths = [
        max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)
    ]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in cells]
    return "\n".join(out)


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """``numerator / denominator`` or None when either is missing or zero."""
    if numerator is None or denominator is None or denominator == 0:
        return None
    if numerator != numerator or denominator != denominator:
        return None
    return numerator / denominator
