"""Per-step timers, progress lines, monitor events, flops profile and comms summary.

The engine calls ``start/stop`` around phases, ``before_forward/after_forward`` around
the module call and ``after_step`` at each optimizer step. This object decides what to
time, print and write (``wall_clock_breakdown``, ``steps_per_print``, monitors,
``flops_profiler``, ``comms_logger``), so none of that logic sits in the engine.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from shardspeed import comm
from shardspeed.profiling import Timers
from shardspeed.utils.logging import log_dist


class StepReporter:
    """Timers + progress log + monitor events + profiling for one engine."""

    PHASES = ("forward", "backward", "backward_reduce", "step")

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        cfg = engine._config
        self.flops_cfg = cfg.flops_profiler
        self.breakdown = bool(cfg.wall_clock_breakdown or self.flops_cfg.enabled)
        self.steps_per_print = cfg.steps_per_print
        self.timers = Timers()
        self._loss_sum = 0.0
        self._loss_count = 0
        self._window_start = time.perf_counter()
        self._window_samples = 0
        self.monitor = self._build_monitor(cfg)
        self.flops_profiler = None
        self._profiling = False
        if self.flops_cfg.enabled:
            from shardspeed.profiling.flops_profiler import FlopsProfiler

            self.flops_profiler = FlopsProfiler(
                engine.module,
                ds_engine=engine,
                recompute_fwd_factor=self.flops_cfg.recompute_fwd_factor,
            )
        self.comms_logging = bool(cfg.comms_logger.enabled)
        if self.comms_logging:
            comm.configure(deepspeed_config=cfg)

    @staticmethod
    def _build_monitor(cfg: Any) -> Any:
        from shardspeed.monitor import MonitorMaster

        monitor = MonitorMaster(cfg)
        return monitor if monitor.enabled else None

    # -- phases ------------------------------------------------------------------------
    def start(self, name: str) -> None:
        if self.breakdown:
            self.timers(name).start()

    def stop(self, name: str) -> None:
        if self.breakdown:
            self.timers(name).stop()

    def before_forward(self) -> None:
        if (
            self.flops_profiler is not None
            and not self._profiling
            and self.engine.global_steps + 1 == self.flops_cfg.profile_step
            and self.engine.is_gradient_accumulation_boundary()
        ):
            self.flops_profiler.start_profile()
            self._profiling = True
        self.start("forward")

    def after_forward(self) -> None:
        self.stop("forward")
        if self._profiling and self.flops_profiler is not None:
            self.flops_profiler.stop_profile()

    def record_loss(self, loss: torch.Tensor) -> None:
        if self.monitor is not None or self.steps_per_print:
            self._loss_sum += float(loss.detach().float())
            self._loss_count += 1

    # -- per optimizer step --------------------------------------------------------------
    def after_step(self) -> None:
        e = self.engine
        self._window_samples += e._config.train_batch_size
        mean_loss = self._loss_sum / self._loss_count if self._loss_count else None
        if self._profiling and self.flops_profiler is not None:
            fp = self.flops_cfg
            self.flops_profiler.print_model_profile(
                profile_step=fp.profile_step,
                module_depth=fp.module_depth,
                top_modules=fp.top_modules,
                detailed=fp.detailed,
                output_file=fp.output_file,
            )
            self.flops_profiler.end_profile()
            self._profiling = False
        if self.monitor is not None:
            self.monitor.write_events(self._events(mean_loss))
        if self.steps_per_print and e.global_steps % self.steps_per_print == 0:
            self._log_progress(mean_loss)
        self._loss_sum, self._loss_count = 0.0, 0

    def _events(self, mean_loss: float | None) -> list[tuple[str, float, int]]:
        e = self.engine
        x = e.global_samples
        events = [("Train/Samples/lr", e.get_lr()[0], x)] if e.get_lr() else []
        if mean_loss is not None:
            events.append(("Train/Samples/train_loss", mean_loss, x))
        if e.fp16_enabled():
            events.append(("Train/Samples/loss_scale", e.loss_scaler.loss_scale, x))
        if self.breakdown:
            means = self.timers.get_mean(list(self.PHASES), reset=False)
            events += [(f"Train/Samples/elapsed_time_ms_{k}", v, x) for k, v in means.items()]
        return events

    def _log_progress(self, mean_loss: float | None) -> None:
        e = self.engine
        elapsed = time.perf_counter() - self._window_start
        rate = self._window_samples / elapsed if elapsed > 0 else 0.0
        parts = [f"step={e.global_steps}", f"skipped={e.skipped_steps}", f"lr={e.get_lr()}"]
        parts.append(f"mom={e.get_mom()}")
        if mean_loss is not None:
            parts.append(f"loss={mean_loss:.4f}")
        if e.fp16_enabled():
            parts.append(f"loss_scale={e.loss_scaler.loss_scale:g}")
        parts.append(f"samples/s={rate:.1f}")
        log_dist(", ".join(parts))
        if self.breakdown:
            names = [n for n in self.PHASES if self.timers.has(n)]
            self.timers.log(names, normalizer=max(self.steps_per_print, 1), reset=True)
        if self.comms_logging:
            comm.log_summary()
        self._window_start = time.perf_counter()
        self._window_samples = 0

    def close(self) -> None:
        if self.monitor is not None:
            self.monitor.close()
