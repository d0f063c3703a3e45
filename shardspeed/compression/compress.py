"""DeepSpeed's compression entry points: ``init_compression``, ``redundancy_clean`` and
``student_initialization`` (``deepspeed.compression.compress``).

A compression run::

    model = init_compression(model, ds_config, teacher_model=teacher)  # wrap + attach
    engine, *_ = deepspeed.initialize(model=model, config=ds_config)   # steps the scheduler
    ...train...
    model = redundancy_clean(model, ds_config)                         # fold + shrink

``init_compression`` swaps every ``nn.Linear`` / ``nn.Conv2d`` / ``nn.Embedding`` /
``nn.BatchNorm2d`` for its compressed counterpart (same interface, same parameters) and
attaches each enabled technique to the modules its groups name; nothing changes the
forward until the scheduler reaches a technique's ``schedule_offset``.
``redundancy_clean`` folds every technique into plain weights: quantized weights keep their
quantized values, masks are multiplied in, and pruned rows / heads / channels are removed
(with their related modules' matching inputs) so the model really shrinks.
"""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

from shardspeed.compression.attention_heads import HeadCountSync, check_gqa_head_blocks
from shardspeed.compression.conv import CompressedConv2d
from shardspeed.compression.engine_hook import refuse_tensor_parallel
from shardspeed.compression.linear import CompressedEmbedding, CompressedLinear
from shardspeed.compression.matching import get_submodule, wrap_compressible
from shardspeed.compression.plan import GroupPlan, plan_all
from shardspeed.compression.shrink import fold_group
from shardspeed.compression.zero3 import gather_zero3, is_partitioned
from shardspeed.config.compression import (
    ACTIVATION_QUANTIZATION,
    CHANNEL_PRUNING,
    HEAD_PRUNING,
    ROW_PRUNING,
    SPARSE_PRUNING,
    WEIGHT_QUANTIZATION,
    get_compression_config,
)

logger = logging.getLogger(__name__)

_SUPPORTS: dict[str, tuple[type, ...]] = {
    WEIGHT_QUANTIZATION: (CompressedLinear, CompressedConv2d, CompressedEmbedding),
    ACTIVATION_QUANTIZATION: (CompressedLinear, CompressedConv2d),
    SPARSE_PRUNING: (CompressedLinear, CompressedConv2d),
    ROW_PRUNING: (CompressedLinear,),
    HEAD_PRUNING: (CompressedLinear,),
    CHANNEL_PRUNING: (CompressedConv2d,),
}


def _unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside an engine (DeepSpeed's ``model.module``)."""
    inner = getattr(model, "module", None)
    return inner if isinstance(inner, nn.Module) else model


def _refuse_mpu(mpu: Any) -> None:
    if mpu is not None:
        raise ValueError(
            f"mpu={type(mpu).__name__}: compression of tensor-parallel (Megatron "
            "ColumnParallelLinear / RowParallelLinear) layers is not implemented; allowed: "
            "mpu=None. Fix: compress the unsliced model (before AutoTP slices it) and pass "
            "mpu=None."
        )


def _torch_layer(cls: type) -> str:
    """The ``torch.nn`` layer a compressed class extends (``Linear`` for ``CompressedLinear``)."""
    return next(c.__name__ for c in cls.__mro__ if c.__module__.startswith("torch.nn"))


def _attach(module: nn.Module, name: str, plan: GroupPlan) -> None:
    supported = _SUPPORTS[plan.technique]
    if not isinstance(module, supported):
        kinds = ", ".join(_torch_layer(t) for t in supported)
        raise ValueError(
            f"compression_training.{plan.technique}.different_groups.{plan.name}: module "
            f"'{name}' is a {_torch_layer(type(module))}; allowed for {plan.technique}: "
            f"{kinds}. Fix: narrow the group's 'modules' patterns to exclude it."
        )
    shared, params = plan.shared, plan.params
    if plan.technique == WEIGHT_QUANTIZATION:
        module.enable_weight_quantization(
            params.start_bits,
            params.target_bits,
            params.quantization_period,
            shared.quantize_weight_in_forward,
            shared.quantization_type,
            shared.quantize_groups,
        )
    elif plan.technique == ACTIVATION_QUANTIZATION:
        module.enable_activation_quantization(
            params.bits, shared.quantization_type, shared.range_calibration
        )
    elif plan.technique == SPARSE_PRUNING:
        module.enable_sparse_pruning(params.dense_ratio, shared.method)
    elif plan.technique == ROW_PRUNING:
        module.enable_row_pruning(params.dense_ratio, shared.method)
    elif plan.technique == HEAD_PRUNING:
        module.enable_head_pruning(params.dense_ratio, shared.method, shared.num_heads)
    else:
        module.enable_channel_pruning(params.dense_ratio, shared.method)


def init_compression(
    model: nn.Module,
    deepspeed_config: Any,
    teacher_model: nn.Module | None = None,
    mpu: Any = None,
) -> nn.Module:
    """Make ``model`` compression-aware as the ``compression_training`` block says.

    Args:
        model: the model (or an engine; its ``module`` is compressed).
        deepspeed_config: the ds_config dict or JSON path.
        teacher_model: the model to copy layers from when ``layer_reduction`` is enabled.
        mpu: must be None (tensor-parallel layers are not supported).

    Returns:
        ``model``, with its layers swapped in place.

    Raises:
        ConfigError: a key of ``compression_training`` is wrong.
        ValueError: layer reduction without ``teacher_model``, a group naming a module its
            technique cannot compress, or a non-None ``mpu``.
    """
    _refuse_mpu(mpu)
    config = get_compression_config(deepspeed_config)
    inner = _unwrap(model)
    reduction = ["layer_reduction"] if config.layer_reduction.enabled else []
    refuse_tensor_parallel(inner, config.enabled_techniques() + reduction)
    _refuse_partitioned(inner)
    if config.layer_reduction.enabled:
        if teacher_model is None:
            raise ValueError(
                "teacher_model=None with compression_training.layer_reduction.enabled=true; "
                "allowed: the full-depth teacher nn.Module. Fix: pass teacher_model=... or "
                "disable layer_reduction."
            )
        student_initialization(inner, teacher_model, config)
    plans = plan_all(inner, config)
    for plan in plans:
        if plan.technique == HEAD_PRUNING:
            check_gqa_head_blocks(inner, plan.module_names, plan.shared.num_heads)
    wrap_compressible(inner)
    for plan in plans:
        for name in plan.module_names:
            _attach(get_submodule(inner, name), name, plan)
    for plan in plans:
        logger.info(
            "compression: %s group '%s' on %d module(s)",
            plan.technique,
            plan.name,
            len(plan.module_names),
        )
    return model


def _refuse_partitioned(model: nn.Module) -> None:
    if any(is_partitioned(p) for p in model.parameters()):
        raise ValueError(
            "init_compression: the model's parameters are ZeRO-3 partitioned (built under "
            "zero.Init, or already in a stage-3 engine), so l1 masks and head sizes cannot "
            "be computed from whole weights; allowed: a model with whole parameters. Fix: "
            "build the model without zero.Init and call init_compression before "
            "shardspeed.initialize (stage 3 partitions it afterwards)."
        )


def redundancy_clean(model: nn.Module, deepspeed_config: Any, mpu: Any = None) -> nn.Module:
    """Fold every technique into plain weights and remove what pruning dropped.

    Weight quantization leaves the quantized values in the weights (the target bits when
    quantized in forward); sparse masks are multiplied in; row / head / channel pruning with
    ``related_modules`` removes the pruned rows, heads or channels here and the matching
    inputs of the related modules (without them, the pruned parts are zeroed). Attention
    modules whose q/k/v lost heads get their head-count attributes updated, and a Hugging
    Face model's shared ``config`` its ``num_attention_heads`` / ``num_key_value_heads`` /
    ``head_dim`` (so ``save_pretrained`` writes a loadable checkpoint).

    Under ZeRO stage 3 pass the engine: every rank gathers the whole weights (a
    collective), the engine is destroyed (its hooks removed) and the cleaned full module is
    returned instead of the engine; save it with ``save_pretrained`` / ``torch.save``.

    Returns:
        ``model``, changed in place (the engine's module for a ZeRO-3 engine).
    """
    _refuse_mpu(mpu)
    config = get_compression_config(deepspeed_config)
    inner = _unwrap(model)
    if gather_zero3(model):
        model = inner  # the engine is destroyed: the module is a plain, full model now
    heads = HeadCountSync()
    for plan in plan_all(inner, config):
        fold_group(inner, plan, heads)
    heads.apply(inner)
    return model


def student_initialization(
    student_model: nn.Module, teacher_model: nn.Module, deepspeed_config: Any
) -> None:
    """Copy teacher layers into a shallower student (``layer_reduction``).

    Student layer ``i`` (``<module_name_prefix>.<i>``) receives teacher layer
    ``teacher_layer[i]``; each module of ``other_module_name`` (embeddings, pooler, head) is
    copied whole. Parameters are copied in registration order and must match in shape.
    """
    reduction = get_compression_config(deepspeed_config).layer_reduction
    prefix = reduction.module_name_prefix
    pairs = [(f"{prefix}.{i}", f"{prefix}.{t}") for i, t in enumerate(reduction.teacher_layer)]
    pairs += [(name, name) for name in reduction.other_module_name]
    for student_name, teacher_name in pairs:
        try:
            student = get_submodule(student_model, student_name)
            teacher = get_submodule(teacher_model, teacher_name)
        except AttributeError as exc:
            raise ValueError(
                f"compression_training.layer_reduction: no module '{student_name}' in the "
                f"student or '{teacher_name}' in the teacher ({exc}); allowed: dotted module "
                "names of both models. Fix: correct module_name_prefix / teacher_layer / "
                "other_module_name."
            ) from None
        for s_param, t_param in zip(student.parameters(), teacher.parameters(), strict=False):
            s_param.data.copy_(t_param.data)
        logger.info("layer_reduction: student %s <- teacher %s", student_name, teacher_name)
