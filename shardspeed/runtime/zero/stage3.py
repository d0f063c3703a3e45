"""``deepspeed.runtime.zero.stage3`` path: the ZeRO-3 memory estimators and generation on
gathered weights.

RL trainers generate with the model they train. At ZeRO-3 every forward gathers each unit
and releases it after, which for token-by-token decoding means one all-gather per unit per
token. :func:`unwrap_model_for_generation` (DeepSpeed's name) instead gathers every
parameter once, stands the per-unit hooks aside while the block runs, and releases the
gathered copies on exit, as the hybrid engine does (:mod:`shardspeed.runtime.hybrid`).

TRL (``trl.models.utils._unwrap_model_for_generation``) does the same by hand on a
DeepSpeed engine: ``GatheredParameters(engine.parameters())``, then removes the
optimizer's ``parameter_offload.forward_hooks`` / ``backward_hooks`` and re-registers them
with ``_register_deepspeed_module``. :class:`ParameterOffloadHooks` is that surface over the
stage-3 fetch coordinator: removing the hooks pauses it, re-registering resumes it.
:func:`attach_parameter_offload` puts it where TRL looks (``engine.optimizer.
parameter_offload``) and gives the module and parameters the two attributes TRL reads
(``module.ds_external_parameters()``, ``param.ds_active_sub_modules``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch.nn as nn

from shardspeed.zero.estimate import (
    estimate_zero3_model_states_mem_needs,
    estimate_zero3_model_states_mem_needs_all_cold,
    estimate_zero3_model_states_mem_needs_all_live,
)


def _coordinator(model: Any) -> Any:
    """The stage-3 fetch coordinator of an engine (``None`` at stages 0-2 / for a module)."""
    return getattr(getattr(model, "sharding", None), "coordinator", None)


@contextlib.contextmanager
def unwrap_model_for_generation(model: Any) -> Iterator[Any]:
    """Gather every ZeRO-3 parameter of ``model`` (an engine) for the block and pause the
    per-unit gather/release hooks; yields ``model``. On exit the gathered copies are
    released and the hooks resume. A collective over the data-parallel group: every rank
    enters it. At stages 0-2 (or for a plain module) parameters are whole already and the
    block runs as is."""
    from shardspeed.zero.init import GatheredParameters

    coordinator = _coordinator(model)
    if coordinator is None:
        yield model
        return
    with GatheredParameters(list(model.parameters())):
        coordinator.paused = True
        try:
            yield model
        finally:
            coordinator.paused = False


class _HookHandle:
    """A removable handle, as ``register_forward_hook`` returns; removing every handle of
    its owner pauses the stage-3 hooks."""

    def __init__(self, owner: ParameterOffloadHooks) -> None:
        self.owner = owner

    def remove(self) -> None:
        self.owner._removed(self)


class _TraceView:
    """DeepSpeed's ``param_coordinator`` trace calls over the recorded forward order."""

    def __init__(self, coordinator: Any) -> None:
        self.coordinator = coordinator

    def is_invalid_trace(self) -> bool:
        """No forward order recorded (the next forward records one)."""
        return not self.coordinator.prev_order

    def _invalidate_trace(self) -> None:
        """Forget the recorded order: the next forward records it anew (no prefetch or
        keep-for-backward decisions from a stale order)."""
        self.coordinator.prev_order = []


class ParameterOffloadHooks:
    """DeepSpeed's ``DeepSpeedZeRoOffload`` hook surface over the stage-3 coordinator
    (module docstring): ``forward_hooks`` / ``backward_hooks`` hold handles; once all are
    removed the per-unit hooks stand aside; ``_register_deepspeed_module`` resumes them."""

    def __init__(self, module: nn.Module, coordinator: Any) -> None:
        self.module = module
        self.coordinator = coordinator
        self.param_coordinator = _TraceView(coordinator)
        self.forward_hooks: list[_HookHandle] = []
        self.backward_hooks: list[_HookHandle] = []
        self._register_deepspeed_module(module)

    def _removed(self, handle: _HookHandle) -> None:
        # the lists are left alone: callers iterate over them while removing
        self._installed.discard(id(handle))
        if not self._installed:
            self.coordinator.paused = True

    def _register_deepspeed_module(self, module: nn.Module) -> None:
        """(Re-)install the hooks on ``module`` (the engine's module): resume fetching."""
        if module is not self.module:
            raise ValueError(
                f"_register_deepspeed_module(module): got a {type(module).__name__} that is not "
                "the engine's module; pass optimizer.parameter_offload.module."
            )
        self.forward_hooks = [_HookHandle(self)]
        self.backward_hooks = [_HookHandle(self)]
        self._installed = {id(h) for h in self.forward_hooks + self.backward_hooks}
        self.coordinator.paused = False


def attach_parameter_offload(engine: Any) -> ParameterOffloadHooks | None:
    """Give a ZeRO-3 engine DeepSpeed's ``engine.optimizer.parameter_offload`` (TRL's
    generation path, module docstring); returns it, or ``None`` at stages 0-2 or without an
    optimizer. Idempotent."""
    coordinator = _coordinator(engine)
    optimizer = getattr(engine, "optimizer", None)
    if coordinator is None or optimizer is None:
        return None
    existing = getattr(optimizer, "parameter_offload", None)
    if isinstance(existing, ParameterOffloadHooks):
        return existing
    module = engine.module
    external = [p for m in module.modules() for p in getattr(m, "_ss_external_params", {}).values()]
    if "ds_external_parameters" not in module.__dict__:
        named = [(f"ds_external_{i}", p) for i, p in enumerate(external)]
        module.ds_external_parameters = lambda: list(named)
    for p in module.parameters():
        if not hasattr(p, "ds_active_sub_modules"):
            p.ds_active_sub_modules = set()  # DeepSpeed's per-parameter set of running modules
    optimizer.parameter_offload = ParameterOffloadHooks(module, coordinator)
    return optimizer.parameter_offload


__all__ = [
    "ParameterOffloadHooks",
    "attach_parameter_offload",
    "estimate_zero3_model_states_mem_needs",
    "estimate_zero3_model_states_mem_needs_all_cold",
    "estimate_zero3_model_states_mem_needs_all_live",
    "unwrap_model_for_generation",
]
