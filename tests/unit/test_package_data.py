"""Every C++ source that a kernel JIT-builds at run time ships with the package: its folder
is listed under ``[tool.setuptools.package-data]`` in pyproject.toml (a wheel without it
would fail the build on first use and fall back to slower torch paths)."""

from __future__ import annotations

from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

REPO = Path(__file__).resolve().parents[2]


def test_every_cpp_source_is_package_data() -> None:
    data = tomllib.loads((REPO / "pyproject.toml").read_text())
    listed = data["tool"]["setuptools"]["package-data"]
    for source in sorted((REPO / "shardspeed").rglob("*.cpp")):
        package = ".".join(source.parent.relative_to(REPO).parts)
        assert "*.cpp" in listed.get(package, []), f"{source.name}: add {package!r} to package-data"
