"""A compiled training step: ``torch.compile`` of the model's forward inside the engine.

What is compiled and why it keeps ZeRO correct (stages 0-2)::

    engine.forward -> module.__call__ -> [compiled: forward graph + AOTAutograd backward graph]
    engine.backward -> autograd runs the compiled backward graph, then each parameter's
                       AccumulateGrad node (eager) -> the reducer's post-accumulate-grad hook
                       -> bucketed reduction overlapping the rest of backward (unchanged)

Compiling the *forward* (``nn.Module.compile``) leaves autograd's leaf nodes outside the
graph, so the reducer's hooks fire exactly as in eager. ZeRO-3 gathers and releases
parameters in module forward hooks, which must not be traced into a graph: at stage 3 each
unit's ``forward`` is compiled instead and the hooks stay eager around it
(:mod:`shardspeed.runtime.compile_units`).

Compilation is lazy (the first forward traces and compiles). If that fails on a model
(an unsupported construct, a backend or C++ compiler error), the module falls back to
eager for good and one warning names the exception; a user error that eager also raises
surfaces from the eager re-run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch.nn as nn

from shardspeed.runtime.compile_units import CompiledUnits, compile_units
from shardspeed.utils.logging import get_logger, log_dist

if TYPE_CHECKING:
    from shardspeed.zero.fetch import Unit

logger = get_logger(__name__)

DEFAULT_BACKEND = "inductor"


@dataclass
class CompileState:
    """What was compiled, how, and whether it fell back to eager (and why)."""

    backend: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    fallback_reason: str | None = None
    # ZeRO-3: module class -> why its units fell back to eager (others may stay compiled)
    unit_fallbacks: dict[str, str] = field(default_factory=dict)

    @property
    def active(self) -> bool:
        """True while the compiled forward is in use (not fallen back)."""
        return self.fallback_reason is None


class _GuardedCompiledCall:
    """``module._compiled_call_impl`` that falls back to eager on a compilation failure."""

    def __init__(self, module: nn.Module, compiled: Any, state: CompileState) -> None:
        self.module = module
        self.compiled = compiled
        self.state = state

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from torch._dynamo.exc import TorchDynamoException

        try:
            return self.compiled(*args, **kwargs)
        except TorchDynamoException as exc:
            lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
            reason = f"{type(exc).__name__}: {' '.join(lines[:2])[:400]}"
            self.state.fallback_reason = reason
            self.module._compiled_call_impl = None  # nn.Module.__call__ runs eager again
            logger.warning(
                "compile: torch.compile(backend=%r) failed on %s; running the model eagerly "
                "from now on. Reason: %s",
                self.state.backend,
                type(self.module).__name__,
                reason,
            )
            return self.module._call_impl(*args, **kwargs)


def check_compilable(schedule: Any = None, compiled_autograd: bool = False) -> None:
    """Refuse what the compiled forward does not support, naming it and the fix.

    Raises:
        ValueError: a DeepCompile ``schedule``, or compiled autograd.
    """
    if schedule is not None:
        raise ValueError(
            f"compile: schedule={schedule!r} is a DeepCompile pass schedule; DeepCompile is "
            "not implemented. Fix: call engine.compile() without schedule."
        )
    if compiled_autograd:
        raise ValueError(
            "compile: compiled_autograd_enabled=True is not implemented (only the forward is "
            "compiled; backward runs its AOTAutograd graph). Fix: pass "
            "compiled_autograd_enabled=False."
        )


def _new_state(backend: Any, kwargs: dict[str, Any] | None) -> CompileState:
    """The state of a compilation; ``backend`` in ``kwargs`` is dropped, as in DeepSpeed,
    with a warning."""
    kwargs = dict(kwargs or {})
    if "backend" in kwargs:
        logger.warning(
            "compile: 'backend' in the compile kwargs (%r) is overridden by backend=%r.",
            kwargs.pop("backend"),
            backend,
        )
    return CompileState(backend=getattr(backend, "__name__", str(backend)), kwargs=kwargs)


def _refused(backend: Any, kwargs: dict[str, Any], exc: Exception) -> ValueError:
    """torch.compile refused an unknown backend name or keyword argument."""
    import torch._dynamo

    return ValueError(
        f"compile: torch.compile(backend={backend!r}, **{kwargs!r}) was refused: {exc}. "
        f"Allowed backends: {', '.join(torch._dynamo.list_backends())} (or a callable); "
        "kwargs: torch.compile's keyword arguments. Fix compile.backend / compile.kwargs."
    )


def compile_module(
    module: nn.Module, backend: str = DEFAULT_BACKEND, kwargs: dict[str, Any] | None = None
) -> CompileState:
    """Compile ``module``'s forward in place (``nn.Module.compile``) with a guarded fallback.

    Args:
        module: the (already cast and hooked) model the engine wraps.
        backend: a ``torch.compile`` backend name or callable.
        kwargs: further ``torch.compile`` keyword arguments (``backend`` in them is ignored,
            as in DeepSpeed, with a warning).
    """
    state = _new_state(backend, kwargs)
    try:
        module.compile(backend=backend, **state.kwargs)
    except (RuntimeError, TypeError) as exc:  # an unknown backend name or keyword argument
        raise _refused(backend, state.kwargs, exc) from exc
    module._compiled_call_impl = _GuardedCompiledCall(module, module._compiled_call_impl, state)
    log_dist(f"compile: model forward compiled lazily with torch.compile(backend={backend!r})")
    return state


def compile_zero3_units(
    units: Sequence[Unit], backend: Any = DEFAULT_BACKEND, kwargs: dict[str, Any] | None = None
) -> tuple[CompileState, CompiledUnits]:
    """ZeRO-3: compile each unit's forward (hooks stay eager); see :mod:`compile_units`."""
    state = _new_state(backend, kwargs)
    try:
        return state, compile_units(units, backend, state.kwargs, state)
    except (RuntimeError, TypeError) as exc:  # an unknown backend name or keyword argument
        raise _refused(backend, state.kwargs, exc) from exc


class CompileApiMixin:
    """DeepSpeed's ``engine.compile()`` / ``engine.is_compiled``; expects ``module``,
    ``stage``, ``sharding`` (its ``units`` at stage 3) and ``_config`` (whose ``compile``
    block :meth:`_compile_from_config` reads)."""

    module: nn.Module
    stage: int
    sharding: Any
    _config: Any
    compile_state: CompileState | None = None
    compiled_units: CompiledUnits | None = None  # stage 3: the per-unit compiled forwards

    def _compile_from_config(self) -> None:
        """Compile the forward when the config's ``compile.enabled`` is true."""
        block = self._config.compile
        if block.enabled:
            self.compile(backend=block.backend, compile_kwargs=block.kwargs)

    def compile(
        self,
        backend: Any = DEFAULT_BACKEND,
        compile_kwargs: dict[str, Any] | None = None,
        schedule: Any = None,
        compiled_autograd_enabled: bool = False,
    ) -> None:
        """Compile the wrapped model's forward with ``torch.compile`` (DeepSpeed's method).

        At ZeRO stage 3 each unit's forward is compiled and the gather/release hooks stay
        eager (:mod:`shardspeed.runtime.compile_units`). A second call is a no-op. Raises
        ``ValueError`` with a DeepCompile ``schedule``, with compiled autograd, for a
        backend/keyword torch.compile refuses, or (stage 3) for a CUDA-graph ``mode``.
        """
        check_compilable(schedule, compiled_autograd_enabled)
        if self.compile_state is not None:
            return
        if self.stage >= 3:
            units = self.sharding.units
            self.compile_state, self.compiled_units = compile_zero3_units(
                units, backend, compile_kwargs
            )
            return
        self.compile_state = compile_module(self.module, backend, compile_kwargs)

    @property
    def is_compiled(self) -> bool:
        """True when the forward is compiled (false again after a fallback to eager)."""
        return self.compile_state is not None and self.compile_state.active
