"""``FlopsProfiler``: per-module FLOPs, MACs, parameters and latency of a model's forward.

Counting is done by :class:`FlopCountMode` (the ATen ops that actually run); attribution
to modules by forward pre/post hooks that keep a stack of the modules currently inside
their ``forward``. An op counts towards every module on the stack, so each module's
numbers are inclusive of its children; containers that are never called themselves (e.g.
``nn.ModuleList``) report the sum of their children. Only ops run inside the profiled
model's forward are counted: backward and optimizer work between ``start_profile`` and
``stop_profile`` are not (training FLOPs are estimated as ``(3 + recompute_fwd_factor)``
times the forward, as DeepSpeed does).
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch.nn as nn

from shardspeed.accelerator import get_accelerator
from shardspeed.profiling.flops_profiler.counter import FlopCountMode, warm_up_dispatch
from shardspeed.profiling.flops_profiler.report import (
    build_report,
    duration_to_string,
    flops_to_string,
    macs_to_string,
    params_to_string,
)
from shardspeed.utils.io import atomic_write_text
from shardspeed.utils.logging import get_logger, warning_once

logger = get_logger(__name__)


@dataclass
class ModuleStats:
    """Inclusive totals of one module over the profiled forward calls."""

    flops: int = 0
    macs: int = 0
    duration_s: float = 0.0
    calls: int = 0


class FlopsProfiler:
    """Measure a model's forward FLOPs / MACs / latency per module (DeepSpeed API).

    Args:
        model: the module to profile (for an engine, the user's model).
        ds_engine: optional engine; its timers (``forward``, ``backward``, ``step``), world
            sizes and micro-batch size enrich :meth:`print_model_profile`.
        recompute_fwd_factor: fraction of the forward recomputed in backward (activation
            checkpointing: 1.0 for full recompute) used for the training-FLOPs estimate.
    """

    def __init__(
        self, model: nn.Module, ds_engine: Any = None, recompute_fwd_factor: float = 0.0
    ) -> None:
        self.model = model
        self.ds_engine = ds_engine
        self.recompute_fwd_factor = recompute_fwd_factor
        self.started = False
        self._stats: dict[nn.Module, ModuleStats] = defaultdict(ModuleStats)
        self._op_flops: dict[str, int] = defaultdict(int)
        self._stack: list[nn.Module] = []
        self._starts: list[float] = []
        self._ignore_depth = 0
        self._handles: list[Any] = []
        self._mode: FlopCountMode | None = None
        self._sync = get_accelerator().name == "cuda"

    # ------------------------------------------------------------------ lifecycle

    def start_profile(
        self, ignore_list: list[Any] | None = None, *, count_ops: bool = True
    ) -> None:
        """Reset the counts, hook every module and start counting ops.

        ``ignore_list``: module classes (or instances) whose work is excluded from the
        counts. ``count_ops=False`` records module latencies only, without the op counter's
        per-op Python overhead (``get_model_profile`` times such a separate pass).
        """
        if self.started:
            warning_once("FlopsProfiler.start_profile() called twice; keeping the running profile")
            return
        self.reset_profile()
        if count_ops:
            warm_up_dispatch()
        ignore = tuple(ignore_list or ())
        ignored_types = tuple(t for t in ignore if isinstance(t, type))
        for module in self._modules():
            if module in ignore or (ignored_types and isinstance(module, ignored_types)):
                self._handles.append(module.register_forward_pre_hook(self._enter_ignored))
                self._handles.append(
                    module.register_forward_hook(self._exit_ignored, always_call=True)
                )
            else:
                self._handles.append(module.register_forward_pre_hook(self._enter))
                self._handles.append(module.register_forward_hook(self._exit, always_call=True))
        if count_ops:
            self._mode = FlopCountMode(self._on_op)
            self._mode.__enter__()
        self.started = True

    def stop_profile(self) -> None:
        """Stop counting and remove the hooks; the counts are kept for the getters."""
        if not self.started:
            return
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._stack, self._starts, self._ignore_depth = [], [], 0
        self.started = False

    def reset_profile(self) -> None:
        """Zero every count (the profiler keeps running if started)."""
        self._stats = defaultdict(ModuleStats)
        self._op_flops = defaultdict(int)

    def end_profile(self) -> None:
        """Stop profiling and drop all counts."""
        self.stop_profile()
        self.reset_profile()

    # ------------------------------------------------------------------ hooks

    def _now(self) -> float:
        if self._sync:
            get_accelerator().synchronize()
        return time.perf_counter()

    def _enter(self, module: nn.Module, inputs: Any) -> None:
        self._stack.append(module)
        self._starts.append(self._now())

    def _exit(self, module: nn.Module, inputs: Any, output: Any) -> None:
        if not self._stack or self._stack[-1] is not module:
            return  # hooks added mid-forward; nothing consistent to record
        self._stack.pop()
        stats = self._stats[module]
        stats.duration_s += self._now() - self._starts.pop()
        stats.calls += 1

    def _enter_ignored(self, module: nn.Module, inputs: Any) -> None:
        self._ignore_depth += 1

    def _exit_ignored(self, module: nn.Module, inputs: Any, output: Any) -> None:
        self._ignore_depth = max(0, self._ignore_depth - 1)

    def _on_op(self, name: str, flops: int, macs: int) -> None:
        if not self._stack or self._ignore_depth:
            return
        for module in dict.fromkeys(self._stack):  # each module once, even if re-entered
            stats = self._stats[module]
            stats.flops += flops
            stats.macs += macs
        self._op_flops[name] += flops

    # ------------------------------------------------------------------ queries

    def _modules(self) -> list[nn.Module]:
        return list(dict.fromkeys(m for _, m in self.model.named_modules()))

    def module_totals(self, module: nn.Module) -> ModuleStats:
        """Inclusive stats of ``module``; a never-called container sums its children."""
        stats = self._stats.get(module)
        if stats is not None and stats.calls:
            return stats
        total = ModuleStats()
        for child in module.children():
            c = self.module_totals(child)
            total.flops += c.flops
            total.macs += c.macs
            total.duration_s += c.duration_s
        return total

    @staticmethod
    def module_params(module: nn.Module) -> int:
        """Number of (unique) parameters of ``module`` and its children."""
        return sum(p.numel() for p in module.parameters())

    def get_total_flops(self, as_string: bool = False) -> int | str:
        """Forward FLOPs of the model over the profiled calls."""
        flops = self.module_totals(self.model).flops
        return flops_to_string(flops) if as_string else flops

    def get_total_macs(self, as_string: bool = False) -> int | str:
        """Forward multiply-accumulates of the model over the profiled calls."""
        macs = self.module_totals(self.model).macs
        return macs_to_string(macs) if as_string else macs

    def get_total_params(self, as_string: bool = False) -> int | str:
        """Number of parameters of the model (tied parameters counted once)."""
        params = self.module_params(self.model)
        return params_to_string(params) if as_string else params

    def get_total_duration(self, as_string: bool = False) -> float | str:
        """Wall time (seconds) spent in the model's forward over the profiled calls."""
        duration = self.module_totals(self.model).duration_s
        return duration_to_string(duration) if as_string else duration

    def use_durations_from(self, other: FlopsProfiler) -> None:
        """Replace this profile's module latencies with those measured by ``other``."""
        for module, stats in self._stats.items():
            stats.duration_s = other._stats[module].duration_s if module in other._stats else 0.0

    def get_flops_by_op(self) -> dict[str, int]:
        """Forward FLOPs per ATen op name (e.g. ``{'addmm': ..., 'native_layer_norm': ...}``)."""
        return dict(sorted(self._op_flops.items(), key=lambda kv: -kv[1]))

    # ------------------------------------------------------------------ output

    def print_model_profile(
        self,
        profile_step: int = 1,
        module_depth: int = -1,
        top_modules: int = 1,
        detailed: bool = True,
        output_file: str | None = None,
    ) -> str:
        """Log (or write to ``output_file``) the profile summary and per-module tree.

        Returns the report text.
        """
        text = build_report(
            self,
            profile_step=profile_step,
            module_depth=module_depth,
            top_modules=top_modules,
            detailed=detailed,
        )
        self._emit(text, output_file)
        return text

    def print_model_aggregated_profile(self, module_depth: int = -1, top_modules: int = 1) -> str:
        """Log the top ``top_modules`` modules by params, MACs and latency at each depth."""
        from shardspeed.profiling.flops_profiler.report import aggregated_section

        text = aggregated_section(self, module_depth=module_depth, top_modules=top_modules)
        self._emit(text, None)
        return text

    @staticmethod
    def _emit(text: str, output_file: str | None) -> None:
        if output_file:
            atomic_write_text(output_file, text)
            logger.info("flops profile written to %s", output_file)
        else:
            logger.info("\n%s", text)
