"""Builders of the CPU optimizer ops: ``CPUAdamBuilder``, ``CPUAdagradBuilder``, ``CPULionBuilder``.

``cpu_adam`` is ShardSpeed's one JIT-built native kernel (:mod:`shardspeed.ops.cpu_adam`);
``load()`` builds it (first use on a machine) and returns the compiled module, whose
``adam_step_`` updates fp32 CPU tensors in place. ``cpu_adagrad`` and ``cpu_lion`` run on
torch's fused CPU kernels (Adagrad) and on PyTorch code (Lion), so there is nothing to
build: ``load()`` returns the module holding ``DeepSpeedCPUAdagrad`` / ``DeepSpeedCPULion``.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path
from types import ModuleType

from shardspeed.ops.op_builder.builder import OpBuilder, OpNotAvailableError, PythonOpBuilder

_CPU_ADAM_FALLBACK = (
    "DeepSpeedCPUAdam still works without it, on torch's fused CPU Adam kernel "
    "(set SHARDSPEED_CPU_ADAM=torch to skip the build attempt)."
)


def _ninja_found() -> bool:
    """Whether torch's JIT build can find ``ninja`` (on PATH, by the venv, or as a package)."""
    if shutil.which("ninja") is not None:
        return True
    if shutil.which("ninja", path=str(Path(sys.executable).parent)) is not None:
        return True
    return importlib.util.find_spec("ninja") is not None


class CPUAdamBuilder(OpBuilder):
    """ShardSpeed's native CPU Adam/AdamW kernel (``cpu_adam.cpp``, built just in time)."""

    BUILD_VAR = "DS_BUILD_CPU_ADAM"
    NAME = "cpu_adam"
    ABSOLUTE_NAME = "shardspeed.ops.cpu_adam"

    def sources(self) -> list[str]:
        from shardspeed.ops.cpu_adam import builder

        return [str(builder.SOURCE)]

    def cxx_args(self) -> list[str]:
        from shardspeed.ops.cpu_adam import builder

        return builder.compiler_flags(builder.cpu_isa_flags())

    def unavailable_reason(self) -> str | None:
        from shardspeed.ops.cpu_adam import builder

        if os.name != "posix":
            return f"the JIT build uses gcc/clang flags and os.name={os.name!r} is not 'posix'."
        try:
            builder.compiler_identity()
        except builder.CpuAdamBuildError as err:
            return f"{err} {_CPU_ADAM_FALLBACK}"
        if not _ninja_found():
            return (
                "ninja is not installed (torch.utils.cpp_extension needs it); run "
                f"`pip install ninja`. {_CPU_ADAM_FALLBACK}"
            )
        return None

    def load_op(self) -> ModuleType:
        from shardspeed.ops.cpu_adam import builder

        try:
            return builder.load_cpu_adam()
        except builder.CpuAdamBuildError as err:
            raise OpNotAvailableError(
                f"cannot load the 'cpu_adam' op (CPUAdamBuilder): {err}\n{_CPU_ADAM_FALLBACK}"
            ) from err


class CPUAdagradBuilder(PythonOpBuilder):
    """``DeepSpeedCPUAdagrad`` (torch's fused CPU Adagrad kernel): :mod:`shardspeed.ops.adagrad`."""

    BUILD_VAR = "DS_BUILD_CPU_ADAGRAD"
    NAME = "cpu_adagrad"
    ABSOLUTE_NAME = "shardspeed.ops.adagrad"


class CPULionBuilder(PythonOpBuilder):
    """``DeepSpeedCPULion`` (PyTorch foreach kernels): :mod:`shardspeed.ops.lion`."""

    BUILD_VAR = "DS_BUILD_CPU_LION"
    NAME = "cpu_lion"
    ABSOLUTE_NAME = "shardspeed.ops.lion"
