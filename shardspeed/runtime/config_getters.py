"""DeepSpeed-style config getters on the engine (``engine.train_batch_size()`` etc.).

DeepSpeed users call these; they are thin reads of the typed config.
"""

from __future__ import annotations

from typing import Any


class ConfigGettersMixin:
    """Mixed into the engine; expects ``self._config`` (a ShardSpeedConfig)."""

    _config: Any

    def train_batch_size(self) -> int:
        return self._config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self._config.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self._config.gradient_accumulation_steps

    def zero_optimization(self) -> bool:
        return self._config.zero_optimization.stage > 0

    def zero_optimization_stage(self) -> int:
        return self._config.zero_optimization.stage

    def zero_reduce_bucket_size(self) -> int:
        return int(self._config.zero_optimization.reduce_bucket_size)

    def zero_overlap_comm(self) -> bool:
        return bool(self._config.zero_optimization.overlap_comm)

    def zero_offload_optimizer(self) -> Any:
        return self._config.zero_optimization.offload_optimizer

    def zero_offload_param(self) -> Any:
        return self._config.zero_optimization.offload_param

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        return bool(self._config.zero_optimization.stage3_gather_16bit_weights_on_model_save)

    def fp16_enabled(self) -> bool:
        return bool(self._config.fp16.enabled)

    def bfloat16_enabled(self) -> bool:
        return bool(self._config.bf16.enabled)

    def fp16_auto_cast(self) -> bool:
        return bool(self._config.fp16.auto_cast)

    def loss_scale(self) -> float:
        return float(self._config.fp16.loss_scale)

    def dynamic_loss_scale(self) -> bool:
        return self._config.fp16.enabled and self._config.fp16.loss_scale == 0

    def gradient_clipping(self) -> float:
        return float(self._config.gradient_clipping)

    def steps_per_print(self) -> int | None:
        return self._config.steps_per_print

    def wall_clock_breakdown(self) -> bool:
        return bool(self._config.wall_clock_breakdown)

    def communication_data_type(self) -> Any:
        return self._config.communication_data_type

    def postscale_gradients(self) -> bool:
        return not self._config.prescale_gradients

    def gradient_predivide_factor(self) -> float:
        return float(self._config.gradient_predivide_factor)

    def dataloader_drop_last(self) -> bool:
        return bool(self._config.dataloader_drop_last)

    def optimizer_name(self) -> str | None:
        return None if self._config.optimizer is None else self._config.optimizer.type

    def optimizer_params(self) -> dict | None:
        return None if self._config.optimizer is None else dict(self._config.optimizer.params)

    def scheduler_name(self) -> str | None:
        return None if self._config.scheduler is None else self._config.scheduler.type

    def scheduler_params(self) -> dict | None:
        return None if self._config.scheduler is None else dict(self._config.scheduler.params)
