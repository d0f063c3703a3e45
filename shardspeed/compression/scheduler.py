"""The compression scheduler: switches each technique on at its ``schedule_offset``.

``step()`` is called once per optimizer step (``step(step_zero_check=True)`` before the
first one); at ``training_steps >= schedule_offset`` (sparse pruning: and
``<= schedule_offset_end`` when set) it sets the technique's flag on every module of its
groups, after which the layers apply it in ``forward``. A technique, once on, stays on.
"""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

from shardspeed.compression.matching import get_submodule
from shardspeed.compression.plan import plan_technique
from shardspeed.config.compression import (
    ACTIVATION_QUANTIZATION,
    CHANNEL_PRUNING,
    HEAD_PRUNING,
    ROW_PRUNING,
    SPARSE_PRUNING,
    TECHNIQUES,
    WEIGHT_QUANTIZATION,
    get_compression_config,
)

logger = logging.getLogger(__name__)

MODULE_FLAG = {
    WEIGHT_QUANTIZATION: "weight_quantization_enabled",
    ACTIVATION_QUANTIZATION: "activation_quantization_enabled",
    SPARSE_PRUNING: "sparse_pruning_enabled",
    ROW_PRUNING: "row_pruning_enabled",
    HEAD_PRUNING: "head_pruning_enabled",
    CHANNEL_PRUNING: "channel_pruning_enabled",
}
"""The module attribute the scheduler sets when a technique switches on."""


class CompressionScheduler:
    """DeepSpeed's ``compression_scheduler(model, compression_config)``.

    Args:
        model: the compressed model (after ``init_compression``).
        compression_config: a ds_config dict / path or a parsed ``CompressionConfig``.
    """

    def __init__(self, model: nn.Module, compression_config: Any) -> None:
        self.model = model
        self.config = get_compression_config(compression_config)
        self.training_steps = 0
        self.weight_quantization_enabled = False
        self.modules: dict[str, list[str]] = {
            technique: [
                name
                for plan in plan_technique(model, self.config, technique)
                for name in plan.module_names
            ]
            for technique in TECHNIQUES
        }
        self.switched_on: set[str] = set()

    def _due(self, technique: str) -> bool:
        shared = self.config.technique(technique).shared_parameters
        if self.training_steps < shared.schedule_offset:
            return False
        end = getattr(shared, "schedule_offset_end", None)
        return end is None or self.training_steps <= end

    def step(self, step_zero_check: bool = False) -> None:
        """Advance one training step (not for the step-0 check) and switch on what is due."""
        if not step_zero_check:
            self.training_steps += 1
        for technique in TECHNIQUES:
            if not self.modules[technique] or not self._due(technique):
                continue
            for name in self.modules[technique]:
                setattr(get_submodule(self.model, name), MODULE_FLAG[technique], True)
            if technique not in self.switched_on:
                self.switched_on.add(technique)
                logger.info("%s is enabled at step %d", technique, self.training_steps)
                if technique == WEIGHT_QUANTIZATION:
                    self.weight_quantization_enabled = True


compression_scheduler = CompressionScheduler
"""DeepSpeed's spelling of the class."""
