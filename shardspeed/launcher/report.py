"""``shardspeed report``: what this environment offers ShardSpeed (like ``ds_report``).

:func:`collect_report` gathers the facts into a plain dict (JSON-serialisable, tested);
:func:`format_report` turns it into the table ``shardspeed report`` prints.
``shardspeed report --json`` prints the dict instead.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

OPTIONAL_PACKAGES: tuple[str, ...] = (
    "transformers",
    "safetensors",
    "deepspeed",
    "tensorboard",
    "wandb",
    "httpx",
)
CPU_FLAGS: tuple[str, ...] = (
    "sse4_2",
    "avx",
    "avx2",
    "fma",
    "avx512f",
    "avx512_bf16",
    "avx512_vnni",
    "amx_bf16",
    "amx_tile",
)
NOT_INSTALLED = "not installed"


def package_version(name: str) -> str:
    """Installed version of distribution ``name``, or ``"not installed"``."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return NOT_INSTALLED


def _torch_info() -> dict[str, Any]:
    try:
        import torch
    except Exception as err:  # pragma: no cover - torch is a dependency
        return {"version": NOT_INSTALLED, "path": None, "error": str(err)}
    return {
        "version": torch.__version__,
        "path": str(Path(torch.__file__).parent),
        "cuda_build": torch.version.cuda,
        "hip_build": getattr(torch.version, "hip", None),
    }


def _cuda_info() -> dict[str, Any]:
    import torch

    available = torch.cuda.is_available()
    devices = []
    if available:
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            devices.append(
                {
                    "index": index,
                    "name": props.name,
                    "capability": f"{props.major}.{props.minor}",
                    "memory_gib": round(props.total_memory / 2**30, 1),
                }
            )
    cudnn = torch.backends.cudnn.version() if available else None
    return {
        "available": available,
        "version": torch.version.cuda,
        "cudnn": cudnn,
        "device_count": len(devices),
        "devices": devices,
    }


def _nccl_info() -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    available = dist.is_available() and dist.is_nccl_available()
    version = None
    if available:
        try:
            raw = torch.cuda.nccl.version()
            version = ".".join(map(str, raw)) if isinstance(raw, tuple) else str(raw)
        except Exception:  # pragma: no cover - NCCL present but unloadable
            version = None
    return {"available": available, "version": version}


def _backend_available(name: str) -> bool:
    import torch.distributed as dist

    if not dist.is_available():
        return False
    return bool(getattr(dist, f"is_{name}_available", lambda: False)())


def _triton_info() -> dict[str, Any]:
    try:
        triton = importlib.import_module("triton")
    except Exception as err:
        reason = NOT_INSTALLED if isinstance(err, ModuleNotFoundError) else str(err)
        return {"importable": False, "version": None, "error": reason}
    return {"importable": True, "version": getattr(triton, "__version__", None), "error": None}


def _cpu_info(cpuinfo_path: str = "/proc/cpuinfo") -> dict[str, Any]:
    model = platform.processor() or platform.machine()
    flags: set[str] = set()
    try:
        text = Path(cpuinfo_path).read_text()
    except OSError:
        text = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and value.strip():
            model = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = set(value.split())
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        usable = os.cpu_count() or 0
    return {
        "model": model,
        "logical_cores": os.cpu_count() or 0,
        "usable_cores": usable,
        "flags": {flag: flag in flags for flag in CPU_FLAGS},
    }


def _shardspeed_info() -> dict[str, Any]:
    import shardspeed

    return {"version": shardspeed.__version__, "path": str(Path(shardspeed.__file__).parent)}


def collect_report() -> dict[str, Any]:
    """Gather the environment facts; every value is JSON-serialisable.

    Keys: ``python``, ``torch``, ``cuda``, ``nccl``, ``gloo``, ``mpi``, ``triton``,
    ``cpu``, ``shardspeed``, ``packages`` (name -> version or ``"not installed"``).
    """
    return {
        "python": {
            "version": platform.python_version(),
            "executable": sys.executable,
            "platform": platform.platform(),
        },
        "torch": _torch_info(),
        "cuda": _cuda_info(),
        "nccl": _nccl_info(),
        "gloo": {"available": _backend_available("gloo")},
        "mpi": {"available": _backend_available("mpi")},
        "triton": _triton_info(),
        "cpu": _cpu_info(),
        "shardspeed": _shardspeed_info(),
        "packages": {name: package_version(name) for name in OPTIONAL_PACKAGES},
    }


def _yes_no(value: bool) -> str:
    return "yes" if value else "no"


def _available_with_version(entry: dict[str, Any]) -> str:
    if not entry["available"]:
        return "no"
    return f"yes ({entry['version']})" if entry.get("version") else "yes"


def _rows(report: dict[str, Any]) -> list[tuple[str, list[tuple[str, str]]]]:
    """The report as ``(section, [(label, value), ...])`` for the table."""
    cuda, cpu, triton = report["cuda"], report["cpu"], report["triton"]
    devices = [
        (f"device {d['index']}", f"{d['name']} (sm {d['capability']}, {d['memory_gib']} GiB)")
        for d in cuda["devices"]
    ]
    flags = " ".join(f"{name}={_yes_no(on)}" for name, on in cpu["flags"].items())
    return [
        (
            "general",
            [
                ("python", f"{report['python']['version']} ({report['python']['executable']})"),
                ("platform", report["python"]["platform"]),
                ("torch version", str(report["torch"]["version"])),
                ("torch path", str(report["torch"]["path"])),
                ("shardspeed version", report["shardspeed"]["version"]),
                ("shardspeed path", report["shardspeed"]["path"]),
            ],
        ),
        (
            "accelerator",
            [
                ("cuda available", _yes_no(cuda["available"])),
                ("torch cuda build", str(cuda["version"])),
                ("cudnn", str(cuda["cudnn"])),
                ("device count", str(cuda["device_count"])),
                *devices,
            ],
        ),
        (
            "communication",
            [
                ("nccl", _available_with_version(report["nccl"])),
                ("gloo", _yes_no(report["gloo"]["available"])),
                ("mpi", _yes_no(report["mpi"]["available"])),
            ],
        ),
        (
            "kernels",
            [("triton", triton["version"] if triton["importable"] else f"no ({triton['error']})")],
        ),
        (
            "cpu",
            [
                ("model", cpu["model"]),
                ("cores (logical / usable)", f"{cpu['logical_cores']} / {cpu['usable_cores']}"),
                ("flags", flags),
            ],
        ),
        ("optional packages", list(report["packages"].items())),
    ]


def format_report(report: dict[str, Any]) -> str:
    """Render :func:`collect_report`'s dict as a sectioned two-column table."""
    sections = _rows(report)
    width = max(len(label) for _, rows in sections for label, _ in rows) + 2
    lines = []
    for title, rows in sections:
        lines.append(f"--- {title} ".ljust(width + 40, "-"))
        lines.extend(f"{label.ljust(width, '.')} {value}" for label, value in rows)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``shardspeed report [--json]``."""
    parser = argparse.ArgumentParser(
        prog="shardspeed report", description="Print the environment ShardSpeed runs in."
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    report = collect_report()
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0
