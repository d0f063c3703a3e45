"""The op-builder base class (DeepSpeed's ``deepspeed.ops.op_builder.builder``).

In DeepSpeed a builder compiles one C++/CUDA extension (ahead of time through ``builder()``
in ``setup.py``, or just in time through ``load()``) and returns the compiled module.
ShardSpeed has few native kernels of its own; its ops are PyTorch code, torch's fused
kernels, or the one JIT-built CPU Adam kernel. A ShardSpeed builder therefore answers the
same questions with what ShardSpeed really has:

* ``is_compatible()`` is True when ShardSpeed can provide the op on this machine;
* ``load()`` returns the module that implements it (cached per op name, as DeepSpeed does);
* an op ShardSpeed does not implement is never compatible, and ``load()`` raises
  :class:`OpNotAvailableError` naming the op, the reason and what to use instead.

Subclasses set ``NAME`` (DeepSpeed's op name), ``ABSOLUTE_NAME`` (the import path of the
module ``load()`` returns) and implement :meth:`OpBuilder.unavailable_reason` and
:meth:`OpBuilder.load_op`. Nothing here imports torch at module level.
"""

from __future__ import annotations

import importlib
import os
import re
import shutil
import subprocess
import time
from types import ModuleType
from typing import Any, ClassVar

from shardspeed.utils.logging import get_logger

logger = get_logger(__name__)

DEFAULT_COMPUTE_CAPABILITIES = "6.0;6.1;7.0"

# CUDA toolkit major version -> (minimum minor, architectures added from that minor on)
_ARCHS_BY_CUDA: dict[int, list[tuple[int, str]]] = {
    11: [(0, "8.0"), (1, "8.6"), (8, "9.0")],
    12: [(0, "8.0;8.6;9.0"), (8, "10.0;12.0")],
}


class OpNotAvailableError(RuntimeError):
    """A builder's op cannot be provided here; the message names the op, why, and the fix."""


def installed_cuda_version() -> tuple[int, int] | None:
    """``(major, minor)`` of the CUDA toolkit's ``nvcc`` under ``CUDA_HOME``, or None."""
    from torch.utils.cpp_extension import CUDA_HOME

    if CUDA_HOME is None:
        return None
    nvcc = os.path.join(CUDA_HOME, "bin", "nvcc")
    try:
        out = subprocess.run([nvcc, "-V"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"release (\d+)\.(\d+)", out)
    return (int(match.group(1)), int(match.group(2))) if match else None


def get_default_compute_capabilities() -> str:
    """``;``-separated CUDA architectures to build for, widened by the installed toolkit.

    Starts from ``6.0;6.1;7.0`` and adds the architectures the installed CUDA toolkit
    (found through ``CUDA_HOME``) can target, as DeepSpeed does; without a toolkit the
    base list is returned.
    """
    caps = DEFAULT_COMPUTE_CAPABILITIES
    version = installed_cuda_version()
    if version is None:
        return caps
    major, minor = version
    for first_minor, archs in _ARCHS_BY_CUDA.get(major, []):
        if minor >= first_minor:
            caps += f";{archs}"
    return caps


class OpBuilder:
    """One op: whether ShardSpeed can provide it here, and the module that implements it."""

    NAME: ClassVar[str] = ""
    BUILD_VAR: ClassVar[str] = ""
    ABSOLUTE_NAME: ClassVar[str] = ""
    _loaded_ops: ClassVar[dict[str, ModuleType]] = {}

    def __init__(self, name: str | None = None) -> None:
        self.name = name or self.NAME
        self.jit_mode = False
        self.build_for_cpu = False
        self.enable_bf16 = False
        self.error_log: str | None = None

    # ----------------------------------------------------------------- subclass hooks
    def unavailable_reason(self) -> str | None:
        """Why the op cannot be provided on this machine (with the fix), or None if it can."""
        return None

    def load_op(self) -> ModuleType:
        """Import (building it first if needed) and return the op's module."""
        raise NotImplementedError(f"{type(self).__name__} does not implement load_op()")

    # ----------------------------------------------------------------- DeepSpeed's surface
    def absolute_name(self) -> str:
        """Import path of the module :meth:`load` returns."""
        return self.ABSOLUTE_NAME or f"shardspeed.ops.{self.NAME}"

    def sources(self) -> list[str]:
        """Source files compiled for this op (empty: the op is Python/PyTorch code)."""
        return []

    def include_paths(self) -> list[str]:
        return []

    def cxx_args(self) -> list[str]:
        return []

    def nvcc_args(self) -> list[str]:
        return []

    def extra_ldflags(self) -> list[str]:
        return []

    def strip_empty_entries(self, args: list[str]) -> list[str]:
        """``args`` without empty strings."""
        return [arg for arg in args if len(arg) > 0]

    def command_exists(self, cmd: str) -> bool:
        """Whether ``cmd`` is an executable on ``PATH``."""
        return shutil.which(cmd) is not None

    def warning(self, msg: str) -> None:
        """Record ``msg`` as this builder's error log and log it."""
        self.error_log = msg
        logger.warning("%s: %s", self.name, msg)

    def is_compatible(self, verbose: bool = False) -> bool:
        """Whether ShardSpeed can provide this op here; ``verbose`` logs the reason if not."""
        reason = self.unavailable_reason()
        self.error_log = reason
        if reason is not None and verbose:
            logger.warning(
                "op %r (%s) is not available: %s", self.name, type(self).__name__, reason
            )
        return reason is None

    def load(self, verbose: bool = False) -> ModuleType:
        """The op's module, loaded once per process (later calls return the cached module)."""
        cached = OpBuilder._loaded_ops.get(self.name)
        if cached is not None:
            return cached
        return self.jit_load(verbose)

    def jit_load(self, verbose: bool = True) -> ModuleType:
        """Load the op now (building its native code first where it has any).

        Raises:
            OpNotAvailableError: ShardSpeed cannot provide the op on this machine.
        """
        reason = self.unavailable_reason()
        if reason is not None:
            self.error_log = reason
            raise OpNotAvailableError(
                f"cannot load the {self.name!r} op ({type(self).__name__}): {reason}"
            )
        start = time.perf_counter()
        module = self.load_op()
        if verbose:
            logger.info("loaded the %s op in %.2f s", self.name, time.perf_counter() - start)
        OpBuilder._loaded_ops[self.name] = module
        return module

    def builder(self) -> Any:
        """DeepSpeed's ahead-of-time ``setup.py`` extension; ShardSpeed builds just in time.

        Raises:
            OpNotAvailableError: always; call :meth:`load` instead.
        """
        raise OpNotAvailableError(
            f"{type(self).__name__}.builder() makes a setup.py extension for DeepSpeed's "
            f"ahead-of-time build; ShardSpeed has no prebuilt ops. Call "
            f"{type(self).__name__}().load() to get the {self.name!r} op at run time."
        )


class PythonOpBuilder(OpBuilder):
    """An op implemented by a ShardSpeed Python module (``ABSOLUTE_NAME``): nothing to build."""

    def load_op(self) -> ModuleType:
        return importlib.import_module(self.absolute_name())


class CUDAOpBuilder(OpBuilder):
    """Base of the builders whose DeepSpeed op is a CUDA extension."""


class UnavailableOpBuilder(CUDAOpBuilder):
    """An op ShardSpeed does not implement: never compatible, ``load()`` says what to use.

    Subclasses set ``WHAT`` (what the DeepSpeed op does) and ``INSTEAD`` (the alternative).
    """

    WHAT: ClassVar[str] = ""
    INSTEAD: ClassVar[str] = ""

    def unavailable_reason(self) -> str:
        return f"ShardSpeed does not implement {self.WHAT}. {self.INSTEAD}"

    def absolute_name(self) -> str:
        return self.ABSOLUTE_NAME or f"deepspeed.ops.{self.NAME}_op"
