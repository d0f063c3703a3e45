"""JIT build of the native CPU Adam kernel, cached per source, compiler and CPU.

:func:`load_cpu_adam` compiles ``cpu_adam.cpp`` with ``torch.utils.cpp_extension.load`` the
first time a process needs it and imports the resulting Python module. The build
directory is ``$TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``) /
``shardspeed_cpu_adam_<key>``, where ``key`` hashes everything the binary depends on: the
source, the compiler flags, the compiler's ``--version``, torch (version and install
directory), the Python version and the CPU's instruction-set flags. ``-march=native`` code
built on one CPU is therefore never loaded on another (a home directory shared over NFS by
different machines gets one build per CPU type), and editing the source or upgrading torch
rebuilds. :func:`load_extension` builds any other C++ source the same way (FastGen's CPU
paged-attention kernel uses it).

Concurrency: torch's own loader serialises builds with a lock file that it creates with
``O_EXCL`` and deletes when done; a builder that is killed leaves the file behind and every
later loader waits on it forever. Builds here are serialised first by ``fcntl.flock`` on a
separate file in the build directory, which the kernel releases when a process dies. While
holding it no other ShardSpeed process can be building, so a torch lock file found then is
stale and is removed. Ranks on one machine thus build once and the others wait, then load
the same library; threads of one process are serialised by a lock as well.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

from shardspeed.utils.logging import get_logger, log_dist, warning_once

logger = get_logger(__name__)

SOURCE = Path(__file__).with_name("cpu_adam.cpp")
EXTENSION_PREFIX = "shardspeed_cpu_adam"

# -ffp-contract=off: keep torch's rounding (no implicit multiply-add fusion);
# -fno-math-errno: lets gcc vectorise sqrt; -fopenmp: at::parallel_for uses torch's threads.
_BASE_CFLAGS = ("-O3", "-fopenmp", "-fno-math-errno", "-ffp-contract=off")


class NativeBuildError(RuntimeError):
    """A JIT-built native kernel cannot be built or loaded on this machine."""


class CpuAdamBuildError(NativeBuildError):
    """The native CPU Adam kernel cannot be built or loaded on this machine."""


def cpu_isa_flags() -> str:
    """The CPU's instruction-set flags (``/proc/cpuinfo`` ``flags``/``Features``), sorted.

    Falls back to ``platform.processor()`` where ``/proc/cpuinfo`` does not exist.
    """
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return " ".join(sorted(value.split()))
    except OSError:
        pass
    return platform.processor() or platform.machine()


def compiler_flags(isa_flags: str) -> list[str]:
    """gcc/clang flags: tuned to this CPU (``-march=native``; 512-bit vectors with AVX-512)."""
    flags = list(_BASE_CFLAGS)
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64", "i686", "i386"):
        flags.append("-march=native")
        if "avx512f" in isa_flags.split():
            flags.append("-mprefer-vector-width=512")
    elif machine in ("aarch64", "arm64", "ppc64le"):
        flags.append("-mcpu=native")
    return flags


def _compiler() -> str:
    return os.environ.get("CXX", "c++")


def compiler_identity() -> str:
    """First line of ``$CXX --version`` (``c++`` when ``CXX`` is unset).

    Raises:
        CpuAdamBuildError: the compiler cannot be run.
    """
    cxx = _compiler()
    try:
        out = subprocess.run(
            [cxx, "--version"], capture_output=True, text=True, timeout=30, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError) as err:
        raise CpuAdamBuildError(
            f"no C++ compiler: running `{cxx} --version` failed ({err}). Install g++ (or set "
            "the CXX environment variable to a C++17 compiler)."
        ) from err
    return out.strip().splitlines()[0] if out.strip() else cxx


def cache_key(source: bytes, cflags: list[str], compiler: str, isa_flags: str) -> str:
    """16 hex digits identifying a binary: source, flags, compiler, torch, Python and CPU.

    The torch installation directory is part of it: two virtual environments with the
    same torch would otherwise share a build directory and rebuild on every switch.
    """
    parts = {
        "source": hashlib.sha256(source).hexdigest(),
        "cflags": cflags,
        "compiler": compiler,
        "torch": torch.__version__,
        "torch_dir": str(Path(torch.__file__).parent),  # its headers are in the ninja file
        "cxx11_abi": bool(torch._C._GLIBCXX_USE_CXX11_ABI),
        "python": sys.version_info[:2],
        "machine": platform.machine(),
        "isa": isa_flags,
    }
    blob = json.dumps(parts, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def extensions_root() -> Path:
    """``$TORCH_EXTENSIONS_DIR`` or torch's default (``~/.cache/torch_extensions``)."""
    from torch.utils.cpp_extension import get_default_build_root

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())


@contextlib.contextmanager
def _ninja_on_path() -> Iterator[None]:
    """Make ``ninja`` findable for torch's build (``pip install ninja`` in an unactivated venv).

    Raises:
        CpuAdamBuildError: no ``ninja`` on ``PATH``, next to the interpreter or in the
            ``ninja`` Python package.
    """
    if shutil.which("ninja") is not None:
        yield
        return
    extra = [str(Path(sys.executable).parent)]
    with contextlib.suppress(ImportError):
        import ninja  # type: ignore[import-not-found]

        extra.append(str(ninja.BIN_DIR))
    search = os.pathsep.join(extra)
    if shutil.which("ninja", path=search) is None:
        raise CpuAdamBuildError(
            "ninja is not installed (torch.utils.cpp_extension needs it to build the kernel). "
            "Fix: `pip install ninja` in this environment."
        )
    with _path_lock:  # builds may run side by side in threads: one edit, undone by the last
        if _path_users[0] == 0:
            _path_saved[0] = os.environ.get("PATH", "")
            os.environ["PATH"] = search + os.pathsep + _path_saved[0]
        _path_users[0] += 1
    try:
        yield
    finally:
        with _path_lock:
            _path_users[0] -= 1
            if _path_users[0] == 0:
                os.environ["PATH"] = _path_saved[0]


_path_lock = threading.Lock()
_path_users = [0]
_path_saved = [""]


@contextlib.contextmanager
def _build_lock(build_dir: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``build_dir`` (released by the kernel if we die)."""
    try:
        import fcntl
    except ImportError:  # not POSIX: rely on torch's own lock file
        yield
        return
    with open(build_dir / "shardspeed_build.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            stale = build_dir / "lock"  # torch's FileBaton file; nobody else can hold it now
            if stale.exists():
                warning_once(
                    f"removing the stale build lock {stale} (left by a build that was killed)"
                )
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


_loaded: ModuleType | CpuAdamBuildError | None = None
_adam_lock = threading.Lock()
_load_lock = threading.Lock()  # guards _source_locks


def load_cpu_adam() -> ModuleType:
    """Build (first use on this machine) and import the kernel's module (``adam_step_``).

    The outcome is cached for the process: a failure is raised again without a second
    build attempt.

    Raises:
        CpuAdamBuildError: not a POSIX system, no compiler, no ninja, or the build failed
            (the message carries the end of the compiler output).
    """
    global _loaded
    with _adam_lock:
        if _loaded is None:
            try:
                _loaded = _build_and_load()
            except CpuAdamBuildError as err:
                _loaded = err
    if isinstance(_loaded, CpuAdamBuildError):
        raise _loaded
    return _loaded


def _build_and_load(
    source: Path | None = None,
    prefix: str = EXTENSION_PREFIX,
    what: str = "the native CPU Adam kernel",
    error: type[NativeBuildError] = CpuAdamBuildError,
) -> ModuleType:
    """Build (if its cached binary is missing) and import one C++ source (default: the CPU
    Adam kernel's ``SOURCE``, read at call time) as a module."""
    source = SOURCE if source is None else source
    if os.name != "posix":
        raise error(f"JIT builds use gcc/clang flags; os.name={os.name!r} is not 'posix'")
    isa = cpu_isa_flags()
    cflags = compiler_flags(isa)
    try:
        compiler = compiler_identity()
    except CpuAdamBuildError as err:
        raise error(str(err)) from err
    key = cache_key(source.read_bytes(), cflags, compiler, isa)
    name = f"{prefix}_{key}"
    build_dir = extensions_root() / name
    library = build_dir / f"{name}.so"
    from torch.utils.cpp_extension import load

    with contextlib.ExitStack() as stack:
        try:
            build_dir.mkdir(parents=True, exist_ok=True)
            stack.enter_context(_build_lock(build_dir))
        except OSError as err:
            raise error(
                f"cannot use the build directory {build_dir} ({err}). Fix: set "
                "TORCH_EXTENSIONS_DIR to a writable directory."
            ) from err
        try:
            stack.enter_context(_ninja_on_path())
        except CpuAdamBuildError as err:
            raise error(str(err)) from err
        if not library.exists():
            log_dist(
                f"building {what} in {build_dir} (first use with this source, compiler and "
                "CPU; about 5-60 s, cached afterwards)"
            )
        start = time.perf_counter()
        try:
            # Build from a copy inside the build directory: torch's ninja file records the
            # source path, so two checkouts of the same source (same key) would otherwise
            # rebuild each other's binary on every switch.
            local = build_dir / source.name
            if not local.exists() or local.read_bytes() != source.read_bytes():
                shutil.copyfile(source, local)
            module = load(
                name=name,
                sources=[str(local)],
                extra_cflags=cflags,
                build_directory=str(build_dir),
                verbose=False,
            )
        except (RuntimeError, OSError, ImportError, subprocess.SubprocessError) as err:
            tail = "\n".join(str(err).strip().splitlines()[-15:])
            raise error(f"building {source.name} in {build_dir} failed:\n{tail}") from err
    logger.debug("loaded %s in %.1f s", library, time.perf_counter() - start)
    return module


_extensions: dict[Path, ModuleType | NativeBuildError] = {}
_source_locks: dict[Path, threading.Lock] = {}


def load_extension(source: Path, prefix: str, what: str) -> ModuleType:
    """Build (first use on this machine) and import the C++ ``source`` as a Python module.

    The same cache key, build directory layout and build lock as the CPU Adam kernel
    (see the module docstring). The outcome is cached for the process: a failure is raised
    again without a second build attempt.

    Raises:
        NativeBuildError: not a POSIX system, no compiler, no ninja, or the build failed.
    """
    with _load_lock:  # one lock per source: different kernels build side by side
        source_lock = _source_locks.setdefault(source, threading.Lock())
    with source_lock:
        if source not in _extensions:
            try:
                _extensions[source] = _build_and_load(source, prefix, what, NativeBuildError)
            except NativeBuildError as err:
                _extensions[source] = err
    outcome = _extensions[source]
    if isinstance(outcome, NativeBuildError):
        raise outcome
    return outcome
