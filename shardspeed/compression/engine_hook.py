"""What the training engine calls so compression follows the steps: one object, two calls.

DeepSpeed's engine builds a ``compression_scheduler`` (and, for in-place weight
quantization, a MoQ quantizer) and drives them from its forward and step. This hook does the
same, in the same order, for ShardSpeed's engine::

    hook = build_compression_hook(module, ds_config, zero_stage)   # None: no compression
    hook.before_forward(global_steps)       # each forward; acts only before the first step
    hook.after_optimizer_step(applied)      # after each optimizer step (skipped: no-op)

* ``before_forward`` at step 0: the step-0 check (techniques with ``schedule_offset`` 0
  switch on) and, if weight quantization is on, one quantization step;
* ``after_optimizer_step`` when the step was applied: a quantization step (weights quantized
  in place at the current bits) if weight quantization is on, then ``scheduler.step()``.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from shardspeed.compression.bit_schedule import WeightBitSchedule
from shardspeed.compression.scheduler import CompressionScheduler
from shardspeed.config.compression import CompressionConfig, get_compression_config


class CompressionTrainingHook:
    """The compression scheduler and weight bit schedule, stepped as the engine steps."""

    def __init__(self, model: nn.Module, config: CompressionConfig) -> None:
        self.scheduler = CompressionScheduler(model, config)
        wq = config.weight_quantization.shared_parameters
        self.bit_schedule = WeightBitSchedule(model, wq) if wq.enabled else None

    def before_forward(self, global_steps: int) -> None:
        """Call at the start of every forward; only forwards before the first step act."""
        if global_steps == 0:
            self.scheduler.step(step_zero_check=True)
            self._quantization_step()

    def after_optimizer_step(self, applied: bool) -> None:
        """Call after each optimizer step; ``applied=False`` (overflow, skipped) does nothing."""
        if not applied:
            return
        self._quantization_step()
        self.scheduler.step()

    def _quantization_step(self) -> None:
        if self.bit_schedule is not None and self.scheduler.weight_quantization_enabled:
            self.bit_schedule.step()


def build_compression_hook(
    module: nn.Module, ds_config: Any, zero_stage: int = 0
) -> CompressionTrainingHook | None:
    """The hook for an engine, or None when the ds_config enables no compression technique.

    Under ZeRO stage 3 every technique that acts in forward works (the stage-3 unit gathers
    the layer's weight and mask scores before its forward runs); weight quantization in
    place (MoQ, ``quantize_weight_in_forward: false``) is refused, as is a tensor-parallel
    model.

    Raises:
        ValueError: in-place weight quantization with ZeRO stage 3, or a model sharded by
            AutoTP / ``tp_model_init``.
    """
    config = get_compression_config(ds_config)
    techniques = config.enabled_techniques()
    if not techniques:
        return None
    refuse_tensor_parallel(module, techniques)
    wq = config.weight_quantization.shared_parameters
    if zero_stage >= 3 and wq.enabled and not wq.quantize_weight_in_forward:
        raise ValueError(
            f"zero_optimization.stage={zero_stage} with compression_training."
            "weight_quantization.shared_parameters.quantize_weight_in_forward=false: in-place "
            "(MoQ) quantization rewrites whole weights after each step, but stage 3 keeps only "
            "a shard of each weight on a rank between forwards; allowed at stage 3: "
            "quantize_weight_in_forward=true. Fix: set quantize_weight_in_forward to true "
            "(float masters, quantized in each forward) or train with ZeRO stage 0-2."
        )
    return CompressionTrainingHook(module, config)


def refuse_tensor_parallel(module: nn.Module, techniques: list[str]) -> None:
    """Refuse compression of a model whose linears are tensor-parallel slices."""
    plan = getattr(module, "shardspeed_tp", None)
    if plan is None or not techniques:
        return
    raise ValueError(
        f"compression_training ({', '.join(techniques)}) on a model sharded for tensor "
        f"parallelism (tp_size={getattr(plan, 'tp_size', '?')}): each rank holds slices of "
        "the linears, so l1 / top-k masks, head blocks and quantization groups would be "
        "chosen per slice, not for the whole layer, and redundancy_clean could not shrink "
        "across ranks; allowed: tensor_parallel.autotp_size 1 (ZeRO 0-3 data parallel). "
        "Fix: compress and redundancy_clean the unsliced model, then serve it with "
        "tensor parallelism (init_inference / pipeline(tensor_parallel=...))."
    )
