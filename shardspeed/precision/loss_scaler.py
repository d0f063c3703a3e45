"""Loss scaling for fp16 training: no-op, static and dynamic scalers.

The engine multiplies the loss by ``scaler.loss_scale`` before backward, checks the
gradients for inf/nan, skips the optimizer step on overflow and then calls
``scaler.update(overflow)``. bf16 and fp32 use :class:`NoOpLossScaler` (scale 1).

Dynamic scaling follows DeepSpeed exactly (ds_config ``fp16`` block):

* overflow, hysteresis exhausted (``hysteresis == 1`` or ``cur_hysteresis == 1``):
  ``scale = max(scale / 2, min_scale)``; an overflow while the scale already sits at
  ``min_scale`` raises :class:`LossScaleMinimumError` (if ``raise_error_at_min_scale``).
* overflow otherwise: ``cur_hysteresis -= 1`` and the scale is kept.
* clean step: ``consecutive_hysteresis`` refills ``cur_hysteresis``; when the number of
  clean updates *before* this one since the last overflow is a positive multiple of
  ``scale_window``, ``scale *= 2`` and ``cur_hysteresis`` is refilled. The first growth
  therefore lands on the ``scale_window + 1``-th clean update (DeepSpeed's counting).
"""

from __future__ import annotations

import math
from typing import Any, Protocol, runtime_checkable

from shardspeed.utils.logging import log_dist


class LossScaleMinimumError(RuntimeError):
    """fp16 gradients overflow even at the minimum loss scale: training cannot go on."""


@runtime_checkable
class LossScaler(Protocol):
    """What the engine needs from a loss scaler."""

    loss_scale: float
    dynamic: bool

    def update(self, overflow: bool) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


def _check_scale(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name}={value!r} must be a positive finite number.")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}={value!r} must be a positive finite number, e.g. 65536.")
    return float(value)


class NoOpLossScaler:
    """Scale 1.0 that never changes (bf16 and fp32 training)."""

    dynamic = False

    def __init__(self) -> None:
        self.loss_scale = 1.0

    def update(self, overflow: bool) -> None:
        """Nothing to adjust."""

    def state_dict(self) -> dict[str, Any]:
        return {"loss_scale": self.loss_scale, "dynamic": False}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Nothing to restore: the scale is always 1."""


class StaticLossScaler:
    """A fixed fp16 loss scale (ds_config ``fp16.loss_scale > 0``)."""

    dynamic = False

    def __init__(self, scale: float) -> None:
        self.loss_scale = _check_scale("fp16.loss_scale", scale)

    def update(self, overflow: bool) -> None:
        """The scale is fixed; an overflowing step is still skipped by the engine."""
        if overflow:
            log_dist(f"fp16 overflow: skipping step, static loss scale {self.loss_scale:g}")

    def state_dict(self) -> dict[str, Any]:
        return {"loss_scale": self.loss_scale, "dynamic": False}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.loss_scale = float(state_dict["loss_scale"])


class DynamicLossScaler:
    """Loss scale that halves on overflow (after ``hysteresis`` overflows) and doubles after
    ``scale_window`` clean steps. See the module docstring for the exact rules.

    Counters for the engine's progress log: ``num_overflows`` (skipped steps) and
    ``num_updates`` (all updates).
    """

    dynamic = True

    def __init__(
        self,
        init_scale: float = 2**16,
        scale_window: int = 1000,
        hysteresis: int = 2,
        consecutive_hysteresis: bool = False,
        min_scale: float = 1.0,
        scale_factor: float = 2.0,
        raise_error_at_min_scale: bool = True,
    ) -> None:
        self.loss_scale = _check_scale("fp16 initial loss scale", init_scale)
        self.min_scale = _check_scale("fp16.min_loss_scale", min_scale)
        if self.loss_scale < self.min_scale:
            raise ValueError(
                f"fp16 initial loss scale {self.loss_scale:g} is below fp16.min_loss_scale="
                f"{self.min_scale:g}; raise initial_scale_power or lower min_loss_scale."
            )
        for name, value in (
            ("fp16.loss_scale_window", scale_window),
            ("fp16.hysteresis", hysteresis),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an integer >= 1.")
        if not scale_factor > 1.0:
            raise ValueError(f"scale_factor={scale_factor!r} must be > 1.")
        self.scale_window = scale_window
        self.hysteresis = hysteresis
        self.cur_hysteresis = hysteresis
        self.consecutive_hysteresis = consecutive_hysteresis
        self.scale_factor = float(scale_factor)
        self.raise_error_at_min_scale = raise_error_at_min_scale
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.num_overflows = 0

    @property
    def num_updates(self) -> int:
        """Number of :meth:`update` calls so far."""
        return self.cur_iter

    def update(self, overflow: bool) -> None:
        """Adjust the scale after one optimizer step (``overflow``: grads had inf/nan)."""
        if overflow:
            self._on_overflow()
        else:
            self._on_clean_step()
        self.cur_iter += 1

    def _on_overflow(self) -> None:
        self.num_overflows += 1
        old = self.loss_scale
        if self.hysteresis == 1 or self.cur_hysteresis == 1:
            if old == self.min_scale and self.raise_error_at_min_scale:
                raise LossScaleMinimumError(
                    f"fp16 gradients overflowed (inf/nan) at the minimum loss scale "
                    f"{self.min_scale:g} ({self.num_overflows} overflows in {self.cur_iter + 1} "
                    "steps): the model produces inf/nan gradients even without scaling, so "
                    "lowering the scale cannot help. Check for a too-high learning rate or a "
                    "diverged loss, inf/nan in the inputs or labels, fp16-unsafe ops (large "
                    'exp/softmax/norm without fp32 upcast); or train in bf16 ("bf16": '
                    '{"enabled": true}), or lower fp16.min_loss_scale.'
                )
            self.loss_scale = max(old / self.scale_factor, self.min_scale)
            log_dist(
                f"fp16 overflow: skipping step, loss scale {old:g} -> {self.loss_scale:g}"
                + (" (overflows early in training are expected)" if self.num_overflows <= 1 else "")
            )
        else:
            self.cur_hysteresis -= 1
            log_dist(
                f"fp16 overflow: skipping step, loss scale {old:g} kept "
                f"(hysteresis {self.cur_hysteresis + 1} -> {self.cur_hysteresis})"
            )
        self.last_overflow_iter = self.cur_iter

    def _on_clean_step(self) -> None:
        if self.consecutive_hysteresis:
            self.cur_hysteresis = self.hysteresis
        clean_before = self.cur_iter - self.last_overflow_iter - 1
        if clean_before > 0 and clean_before % self.scale_window == 0:
            self.cur_hysteresis = self.hysteresis
            self.loss_scale *= self.scale_factor

    def state_dict(self) -> dict[str, Any]:
        return {
            "loss_scale": self.loss_scale,
            "dynamic": True,
            "cur_iter": self.cur_iter,
            "last_overflow_iter": self.last_overflow_iter,
            "cur_hysteresis": self.cur_hysteresis,
            "num_overflows": self.num_overflows,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the scale and counters; the configured window/min/hysteresis are kept."""
        self.loss_scale = float(state_dict["loss_scale"])
        self.cur_iter = int(state_dict.get("cur_iter", 0))
        self.last_overflow_iter = int(state_dict.get("last_overflow_iter", -1))
        self.cur_hysteresis = int(state_dict.get("cur_hysteresis", self.hysteresis))
        self.num_overflows = int(state_dict.get("num_overflows", 0))


def build_loss_scaler(fp16_config: Any | None) -> LossScaler:
    """The scaler for a ds_config ``fp16`` block (duck-typed; None or disabled -> no-op).

    Reads ``enabled``, ``loss_scale`` (0 => dynamic, else static), ``initial_scale_power``
    (init scale ``2**p``), ``loss_scale_window``, ``hysteresis``, ``consecutive_hysteresis``
    and ``min_loss_scale``; missing attributes take DeepSpeed's defaults.
    """
    if fp16_config is None or not getattr(fp16_config, "enabled", False):
        return NoOpLossScaler()
    static_scale = getattr(fp16_config, "loss_scale", 0) or 0
    if static_scale != 0:
        return StaticLossScaler(static_scale)
    power = getattr(fp16_config, "initial_scale_power", 16)
    return DynamicLossScaler(
        init_scale=2.0**power,
        scale_window=getattr(fp16_config, "loss_scale_window", 1000),
        hysteresis=getattr(fp16_config, "hysteresis", 2),
        consecutive_hysteresis=bool(getattr(fp16_config, "consecutive_hysteresis", False)),
        min_scale=getattr(fp16_config, "min_loss_scale", 1),
    )
