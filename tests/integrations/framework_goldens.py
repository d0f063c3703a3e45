"""DeepSpeed 0.19.8's per-step losses for the framework cases (``tests/goldens/frameworks``).

Each golden is the JSON a worker wrote when run by the real DeepSpeed in ``.venv-peers``
(same script, same launcher, 2 ranks): ``{"case", "recorded_with", "ranks": [result of
rank 0, rank 1]}`` with only the loss lists kept. The framework tests compare ShardSpeed's
losses with them at the fp32 parity tolerance, besides the plain PyTorch replay.

Re-record (needs ``.venv-peers``, or the venv ``SHARDSPEED_PEERS_VENV`` names, with DeepSpeed
0.19.8 and trl / peft / lightning / datasets at the test extras' versions):

    SHARDSPEED_RECORD_GOLDENS=1 .venv/bin/python -m pytest -q -m slow \\
        tests/integrations -k deepspeed_golden

Without the variable those slow tests check the stored goldens against a live DeepSpeed run;
they skip where no such venv exists.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from integration_env import free_port, worker_env

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
GOLDENS = ROOT / "tests" / "goldens" / "frameworks"
PEERS_PYTHON = (
    Path(os.environ.get("SHARDSPEED_PEERS_VENV") or ROOT / ".venv-peers") / "bin" / "python"
)
RECORD = os.environ.get("SHARDSPEED_RECORD_GOLDENS", "") not in ("", "0")
TOL = {"rtol": 1e-5, "atol": 1e-6}
LOSS_KEYS = ("losses", "resumed_losses")
PEER_PACKAGES = ("deepspeed", "trl", "peft", "lightning", "datasets")


def _peers_ready() -> bool:
    """The peers venv exists and imports DeepSpeed and the frameworks (found, not imported)."""
    if not PEERS_PYTHON.exists():
        return False
    find = "import importlib.util as u, sys; sys.exit(any(u.find_spec(n) is None for n in %r))"
    done = subprocess.run([str(PEERS_PYTHON), "-c", find % (PEER_PACKAGES,)], timeout=120)
    return done.returncode == 0


needs_peers = pytest.mark.skipif(
    not _peers_ready(),
    reason=f"needs a peers venv (.venv-peers or SHARDSPEED_PEERS_VENV) with {PEER_PACKAGES}",
)


def close(got: list[float], want: list[float]) -> float:
    """Asserts ``got`` equals ``want`` within TOL element-wise; returns the largest gap."""
    assert len(got) == len(want) and got, (len(got), len(want))
    worst = 0.0
    for index, (a, b) in enumerate(zip(got, want, strict=True)):
        assert abs(a - b) <= TOL["atol"] + TOL["rtol"] * abs(b), (index, a, b)
        worst = max(worst, abs(a - b))
    return worst


def golden_path(case: str) -> Path:
    return GOLDENS / f"{case}.json"


def check_golden(case: str, results: list[dict[str, Any]]) -> None:
    """Every rank's loss lists against the stored DeepSpeed golden of ``case``."""
    golden = json.loads(golden_path(case).read_text())
    assert len(golden["ranks"]) == len(results)
    for rank, (result, want) in enumerate(zip(results, golden["ranks"], strict=True)):
        for key in want:
            assert key in result, (rank, key)
            close(result[key], want[key])


def run_with_deepspeed(script: str, out: Path, *args: str, timeout: int = 900) -> list[dict]:
    """``script`` on 2 ranks under ``.venv-peers``' real DeepSpeed (no compatibility shim);
    returns every rank's result."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [str(PEERS_PYTHON), "-m", "shardspeed.launcher", "--nproc", "2"]
    cmd += ["--master_port", str(free_port()), str(HERE / script), str(out), *args]
    done = subprocess.run(
        cmd, capture_output=True, text=True, env=worker_env(None), timeout=timeout, cwd=out
    )
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-6000:])
    return [json.loads((out / name).read_text()) for name in ("result.json", "result_rank1.json")]


def record_or_compare(case: str, script: str, variant: str, out: Path) -> None:
    """The optional live-DeepSpeed path: run ``case`` under DeepSpeed, check it against its
    own plain PyTorch reference, then write the golden (``SHARDSPEED_RECORD_GOLDENS=1``) or
    compare it with the stored one."""
    results = run_with_deepspeed(script, out, variant)
    for result in results:
        assert result["engine"] == "DeepSpeedEngine"
        close(result["losses"], result["reference"])
    if not RECORD:
        check_golden(case, results)
        return
    versions = subprocess.run(
        [str(PEERS_PYTHON), "-c", _VERSIONS], capture_output=True, text=True, check=True
    ).stdout
    golden = {
        "case": f"tests/integrations/{script} OUT {variant} (shardspeed --nproc 2)",
        "recorded_with": json.loads(versions),
        "ranks": [{k: r[k] for k in LOSS_KEYS if k in r} for r in results],
    }
    GOLDENS.mkdir(parents=True, exist_ok=True)
    golden_path(case).write_text(json.dumps(golden, indent=1) + "\n")


_VERSIONS = (
    "import importlib.metadata as m, json; print(json.dumps({n: m.version(n) for n in "
    "('deepspeed', 'torch', 'transformers', 'accelerate', 'trl', 'peft', 'lightning', "
    "'datasets')}))"
)
