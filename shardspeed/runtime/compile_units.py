"""ZeRO-3 compiled step: ``torch.compile`` of each unit's forward, gather/release kept eager.

At stage 3 the :class:`~shardspeed.zero.fetch.FetchCoordinator` gathers a *unit* (a
transformer block: one element of an ``nn.ModuleList``) in the unit's forward pre-hook,
releases it in its forward post-hook, gathers it again when its output's gradient arrives
and releases it once its gradients are reduced. Those hooks swap ``param.data`` between
an empty tensor and a view of the gathered buffer and issue collectives, which dynamo
cannot trace. So, as torchtitan does with FSDP2 (``torch.compile`` per block), the engine
compiles each unit's ``forward`` and leaves ``nn.Module.__call__`` and its hooks eager::

    block.__call__ (eager) -> pre-hook: gather unit      (all-gather, param.data = full view)
                           -> block.forward [compiled: forward graph, AOTAutograd backward]
                           -> post-hook: release unit   (param.data = empty)
    backward: output grad -> multi-grad hook: gather again -> compiled backward graph
              -> AccumulateGrad (eager) -> reducer hook: reduce-scatter, release unit

The compiled graph sees ordinary full parameters: they are graph inputs (dynamo lifts
module parameters as inputs and guards on their shape, dtype and device, not on their
address), so a re-gathered buffer at a new address needs no recompile. AOTAutograd saves
the parameter tensors themselves for backward; the coordinator gathers them back before
the backward graph reads them, exactly as eager autograd relies on. Blocks of one class
share one code object, so they share one graph: the number of graphs does not grow with
the depth of the model.

The root unit (embeddings, final norm, head, loss) runs eagerly: its forward calls the
other units, whose hooks would otherwise be traced. A model with no unit but the root has
its root forward compiled (the root's hooks are in ``__call__`` and stay eager).

Compilation is lazy. A unit whose compilation fails (dynamo cannot trace it, a backend or
C++ compiler error) runs eagerly from then on, with one warning naming the module and the
exception; units of other classes stay compiled.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from shardspeed.utils.logging import get_logger, log_dist

if TYPE_CHECKING:
    from shardspeed.runtime.compile_step import CompileState
    from shardspeed.zero.fetch import Unit

logger = get_logger(__name__)

# torch.compile modes that capture CUDA graphs, which replay the parameters' addresses
# of the capture: a ZeRO-3 unit is gathered into a new buffer at every use
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


def _failure_reason(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {' '.join(lines[:2])[:400]}"


class CompiledUnitForward:
    """A unit module's ``forward`` attribute: the compiled forward, or eager after a failure."""

    def __init__(
        self,
        module: nn.Module,
        name: str,
        units: CompiledUnits,
        eager: Callable[..., Any],
        compiled: Callable[..., Any],
    ) -> None:
        self.module = module
        self.name = name
        self.units = units
        self.eager = eager
        self.compiled = compiled
        self.fallback_reason: str | None = None
        self.num_compiled_calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from torch._dynamo.exc import TorchDynamoException

        if self.fallback_reason is None:
            try:
                out = self.compiled(*args, **kwargs)
                self.num_compiled_calls += 1
                return out
            except TorchDynamoException as exc:
                self.units.fall_back(self, _failure_reason(exc))
        return self.eager(*args, **kwargs)


class CompiledUnits:
    """The compiled forwards of a ZeRO-3 model's units (see the module docstring)."""

    def __init__(self, state: CompileState) -> None:
        self.state = state
        self.forwards: list[CompiledUnitForward] = []
        self._saved: list[tuple[nn.Module, Any]] = []  # (module, instance forward before)

    def install(
        self, targets: Sequence[tuple[str, nn.Module]], backend: Any, kwargs: dict[str, Any]
    ) -> None:
        """Replace each target module's ``forward`` by its compiled forward."""
        for name, module in targets:
            eager = module.forward
            compiled = torch.compile(eager, backend=backend, **kwargs)
            self._saved.append((module, module.__dict__.get("forward")))
            forward = CompiledUnitForward(module, name, self, eager, compiled)
            module.forward = forward  # type: ignore[method-assign]
            self.forwards.append(forward)

    def fall_back(self, forward: CompiledUnitForward, reason: str) -> None:
        """Run ``forward``'s unit eagerly from now on; warn once per module class."""
        forward.fallback_reason = reason
        kind = type(forward.module).__name__
        if kind not in self.state.unit_fallbacks:
            logger.warning(
                "compile: torch.compile(backend=%r) failed on ZeRO-3 unit %s (%s); running "
                "%s units eagerly from now on. Reason: %s",
                self.state.backend,
                forward.name,
                kind,
                kind,
                reason,
            )
        self.state.unit_fallbacks.setdefault(kind, reason)
        for other in self.forwards:  # same class, same code: it would fail the same way
            if type(other.module) is type(forward.module):
                other.fallback_reason = reason
        if all(f.fallback_reason is not None for f in self.forwards):
            self.state.fallback_reason = reason

    @property
    def num_compiled_calls(self) -> int:
        """Forward calls that ran compiled code, over all units."""
        return sum(f.num_compiled_calls for f in self.forwards)

    def remove(self) -> None:
        """Restore every unit's eager ``forward``."""
        for module, before in self._saved:
            if before is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = before  # type: ignore[method-assign]
        self._saved = []
        self.forwards = []


def compile_targets(units: Sequence[Unit]) -> list[tuple[str, nn.Module]]:
    """The modules whose forward is compiled: every unit but the root, or the root alone
    when it is the only unit."""
    others = [(u.name, u.module) for u in units if not u.is_root]
    if others:
        return others
    return [(u.name, u.module) for u in units if u.is_root]


def check_unit_kwargs(kwargs: dict[str, Any]) -> None:
    """Refuse ``torch.compile`` options that cannot work on gathered ZeRO-3 parameters."""
    mode = kwargs.get("mode")
    if mode in CUDA_GRAPH_MODES:
        raise ValueError(
            f"compile: kwargs mode={mode!r} captures CUDA graphs, which replay fixed "
            "parameter addresses; at zero_optimization.stage 3 each unit is gathered into a "
            "new buffer at every use. Allowed at stage 3: mode 'default' or "
            "'max-autotune-no-cudagraphs'. Fix: change compile.kwargs.mode."
        )


def compile_units(
    units: Sequence[Unit], backend: Any, kwargs: dict[str, Any], state: CompileState
) -> CompiledUnits:
    """Compile the forward of each ZeRO-3 unit in place; returns the installed forwards."""
    check_unit_kwargs(kwargs)
    compiled = CompiledUnits(state)
    targets = compile_targets(units)
    compiled.install(targets, backend, kwargs)
    names = ", ".join(name for name, _ in targets[:4]) + (", ..." if len(targets) > 4 else "")
    log_dist(
        f"compile: ZeRO-3 unit forwards compiled lazily with torch.compile(backend={backend!r})"
        f" ({len(targets)} units: {names}); gather/release hooks stay eager"
    )
    return compiled
