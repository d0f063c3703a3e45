"""Per-step timers, progress lines and monitor events for the engine.

The engine calls ``start/stop`` around phases and ``after_step`` at each optimizer step;
this object decides what to time, print and write (``wall_clock_breakdown``,
``steps_per_print``, monitors), so none of that logic sits in the engine's hot path.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from shardspeed.utils.logging import log_dist


class StepReporter:
    """Timers + progress log + monitor events for one engine."""

    PHASES = ("forward", "backward", "backward_reduce", "step")

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        cfg = engine._config
        self.breakdown = bool(cfg.wall_clock_breakdown)
        self.steps_per_print = cfg.steps_per_print
        self._t0: dict[str, float] = {}
        self._elapsed: dict[str, float] = dict.fromkeys(self.PHASES, 0.0)
        self._loss_sum = 0.0
        self._loss_count = 0
        self._window_start = time.perf_counter()
        self._window_samples = 0
        self.monitor = self._build_monitor(cfg)

    @staticmethod
    def _build_monitor(cfg: Any) -> Any:
        try:
            from shardspeed.monitor import MonitorMaster
        except ImportError:
            return None
        monitor = MonitorMaster(cfg)
        return monitor if monitor.enabled else None

    def start(self, name: str) -> None:
        if self.breakdown:
            self._t0[name] = time.perf_counter()

    def stop(self, name: str) -> None:
        if self.breakdown and name in self._t0:
            self._elapsed[name] += time.perf_counter() - self._t0.pop(name)

    def record_loss(self, loss: torch.Tensor) -> None:
        if self.monitor is not None or self.steps_per_print:
            self._loss_sum += float(loss.detach().float())
            self._loss_count += 1

    def after_step(self) -> None:
        e = self.engine
        self._window_samples += e._config.train_batch_size
        mean_loss = self._loss_sum / self._loss_count if self._loss_count else None
        if self.monitor is not None:
            events = [("Train/Samples/lr", e.get_lr()[0], e.global_samples)]
            if mean_loss is not None:
                events.append(("Train/Samples/train_loss", mean_loss, e.global_samples))
            if e.fp16_enabled():
                events.append(
                    ("Train/Samples/loss_scale", e.loss_scaler.loss_scale, e.global_samples)
                )
            if self.breakdown:
                for name in self.PHASES:
                    events.append(
                        (
                            f"Train/Samples/elapsed_time_ms_{name}",
                            self._elapsed[name] * 1e3,
                            e.global_samples,
                        )
                    )
            self.monitor.write_events(events)
        if self.steps_per_print and e.global_steps % self.steps_per_print == 0:
            elapsed = time.perf_counter() - self._window_start
            rate = self._window_samples / elapsed if elapsed > 0 else 0.0
            parts = [
                f"step={e.global_steps}",
                f"skipped={e.skipped_steps}",
                f"lr={e.get_lr()}",
                f"mom={e.get_mom()}",
            ]
            if mean_loss is not None:
                parts.append(f"loss={mean_loss:.4f}")
            if e.fp16_enabled():
                parts.append(f"loss_scale={e.loss_scaler.loss_scale:g}")
            parts.append(f"samples/s={rate:.1f}")
            log_dist(", ".join(parts))
            if self.breakdown:
                n = max(self.steps_per_print, 1)
                log_dist(
                    " | ".join(f"{k}: {self._elapsed[k] * 1e3 / n:.2f} ms" for k in self.PHASES)
                )
                self._elapsed = dict.fromkeys(self.PHASES, 0.0)
            self._window_start = time.perf_counter()
            self._window_samples = 0
        self._loss_sum, self._loss_count = 0.0, 0

    def close(self) -> None:
        if self.monitor is not None:
            self.monitor.close()
