"""DeepSpeed's side of the DeepSpeed-equality tests: recorded goldens, or a live run.

Every DeepSpeed-equality test takes a ``source`` parameter from :data:`ORACLE_SOURCES`:

* ``"golden"`` (always collected): DeepSpeed's results are read from
  ``tests/goldens/<topic>/``, recorded once from a live DeepSpeed run; only ShardSpeed's
  side runs, so a fresh clone without DeepSpeed checks the same numbers;
* ``"deepspeed"`` (generated only when the peers venv has DeepSpeed): DeepSpeed runs live;
  with ``SHARDSPEED_RECORD_GOLDENS=1`` its results rewrite the golden files.

The peers venv is ``.venv-peers`` at the repository root, or ``SHARDSPEED_PEERS_VENV``
(``SHARDSPEED_PEERS_VENV=/nonexistent`` collects the golden variants alone, as CI does).
See ``tests/goldens/README.md``.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import io
import json
import os
import subprocess
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

GOLDENS = Path(__file__).resolve().parent
REPO = GOLDENS.parents[1]
PEERS_ENV = "SHARDSPEED_PEERS_VENV"
RECORD_ENV = "SHARDSPEED_RECORD_GOLDENS"


@functools.cache
def peers_python() -> Path | None:
    """The peers venv's interpreter when it can import ``deepspeed``, else None."""
    venv = Path(os.environ.get(PEERS_ENV) or REPO / ".venv-peers")
    python = venv / "bin" / "python"
    if not python.exists():
        return None
    find = "import importlib.util, sys; sys.exit(importlib.util.find_spec('deepspeed') is None)"
    found = subprocess.run([str(python), "-c", find], capture_output=True, timeout=120)
    return python if found.returncode == 0 else None


def recording() -> bool:
    return os.environ.get(RECORD_ENV, "") not in ("", "0")


# the golden variant always; the live one only where DeepSpeed is installed (never a skip)
ORACLE_SOURCES = ["golden", *(["deepspeed"] if peers_python() is not None else [])]


def live_python() -> str:
    """The peers interpreter, for a ``source == "deepspeed"`` variant (collected only then)."""
    python = peers_python()
    assert python is not None, "the live DeepSpeed variant is generated only with the peers venv"
    return str(python)


def live_env() -> dict[str, str]:
    """Environment of a live DeepSpeed launch: one thread per rank; the repository and
    ``tests/`` importable (a test file run as DeepSpeed's rank script imports ``goldens``)."""
    path = os.pathsep.join([str(REPO), str(GOLDENS.parent)])
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}


def golden_path(topic: str, name: str) -> Path:
    return GOLDENS / topic / name


def load(topic: str, name: str) -> Any:
    """A golden file: ``*.json`` as JSON, ``*.pt`` (``*.pt.gz``: gzipped) with
    ``torch.load(weights_only=True)``."""
    path = golden_path(topic, name)
    if not path.exists():
        raise FileNotFoundError(
            f"golden {path} is missing: record it with {RECORD_ENV}=1 and the peers venv "
            "(tests/goldens/README.md)"
        )
    if path.suffix == ".json":
        return json.loads(path.read_text())
    if path.suffix == ".gz":
        return torch.load(io.BytesIO(gzip.decompress(path.read_bytes())), weights_only=True)
    return torch.load(path, weights_only=True)


def save(topic: str, name: str, data: Any) -> None:
    path = golden_path(topic, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".json":
        path.write_text(_dumps(data) + "\n")
    elif path.suffix == ".gz":  # *.pt.gz: a .pt gzipped (halves many small tensors' records)
        buffer = io.BytesIO()
        torch.save(data, buffer)
        path.write_bytes(gzip.compress(buffer.getvalue(), mtime=0))
    else:
        torch.save(data, path)


def _dumps(data: Any, indent: str = "") -> str:
    """JSON with one dict key per line and every list on one line (small, diffable)."""
    if not isinstance(data, dict) or not data:
        return json.dumps(data)
    inner = indent + " "
    items = [f"{inner}{json.dumps(str(k))}: {_dumps(v, inner)}" for k, v in sorted(data.items())]
    return "{\n" + ",\n".join(items) + "\n" + indent + "}"


def deepspeed_side(
    source: str,
    topic: str,
    name: str,
    run_live: Callable[[], Any],
    compress: Callable[[Any], Any] | None = None,
) -> Any:
    """DeepSpeed's results: the golden file, or ``run_live()`` (recorded when recording).

    ``run_live`` returns JSON-able data for ``*.json``, tensors and plain containers for
    ``*.pt``; ``compress`` (e.g. :func:`summarize` on large tensors) shrinks it for the
    file, so the comparison must accept both forms. When recording, the written file is
    read back and compared, as the golden variant will.
    """
    if source == "golden":
        return load(topic, name)
    assert source == "deepspeed", source
    data = run_live()
    if recording():
        stored = compress(data) if compress is not None else data
        if isinstance(stored, dict):
            stored["recorded_with"] = recorded_with()
        save(topic, name, stored)
        data = load(topic, name)
    return data


SAMPLES = 16  # strided entries a summary keeps


def summarize(tensor: torch.Tensor) -> dict[str, Any]:
    """A large tensor as a golden keeps it: shape, float64 norm, sum and sum of magnitudes,
    and :data:`SAMPLES` evenly strided entries."""
    flat = tensor.detach().double().flatten()
    step = max(1, flat.numel() // SAMPLES)
    return {
        "shape": list(tensor.shape),
        "norm": float(flat.norm()),
        "sum": float(flat.sum()),
        "abs_sum": float(flat.abs().sum()),
        "sample": flat[::step][:SAMPLES].tolist(),
    }


def assert_close_summary(
    actual: torch.Tensor, summary: dict[str, Any], rtol: float, atol: float, msg: str
) -> None:
    """What ``|actual - expected| <= atol + rtol |expected|`` element-wise implies for the
    summary of ``expected``: the sampled entries within it, the norm within
    ``sqrt(n) atol + rtol |expected|``, the sums within ``n atol + rtol sum|expected|``."""
    mine = summarize(actual)
    assert mine["shape"] == summary["shape"], f"{msg}: shape {mine['shape']} vs {summary}"
    n = max(1, actual.numel())
    bounds = {
        "norm": n**0.5 * atol + rtol * summary["norm"],
        "sum": n * atol + rtol * summary["abs_sum"],
        "abs_sum": n * atol + rtol * summary["abs_sum"],
    }
    for key, bound in bounds.items():
        assert abs(mine[key] - summary[key]) <= bound, f"{msg}: {key} {mine[key]} vs {summary}"
    for i, (a, e) in enumerate(zip(mine["sample"], summary["sample"], strict=True)):
        assert abs(a - e) <= atol + rtol * abs(e), f"{msg}: sample {i}: {a} vs {e}"


@functools.cache
def recorded_with() -> dict[str, str]:
    """The peers venv's deepspeed and torch versions (stored in every recorded golden)."""
    show = "import importlib.metadata as m; print(m.version('deepspeed'), m.version('torch'))"
    out = subprocess.run([live_python(), "-c", show], capture_output=True, text=True, timeout=120)
    deepspeed, torch_version = out.stdout.split()
    return {"deepspeed": deepspeed, "torch": torch_version}


def fingerprint(tensors: dict[str, torch.Tensor] | Iterable[torch.Tensor]) -> str:
    """sha256 over names, dtypes, shapes and bytes: a golden's record of its inputs."""
    items = tensors.items() if isinstance(tensors, dict) else enumerate(tensors)
    digest = hashlib.sha256()
    for key, tensor in items:
        t = tensor.detach().cpu().contiguous()
        digest.update(f"{key}:{t.dtype}:{tuple(t.shape)};".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def check_inputs(golden: dict[str, Any], actual: str, what: str) -> None:
    """The inputs this run built are those the golden was recorded from."""
    assert golden["inputs"] == actual, (
        f"{what}: the initial weights/inputs differ from those the golden was recorded with "
        f"(a torch or transformers upgrade changes seeded initialisation); re-record with "
        f"{RECORD_ENV}=1 and the peers venv (tests/goldens/README.md)"
    )
