"""``shardspeed.init_inference`` (``deepspeed.init_inference``): wrap a model for inference.

::

    config   = DeepSpeedInferenceConfig(config dict | JSON path, then **kwargs on top)
    shard:     tensor_parallel.tp_size > 1 -> AutoTP (or injection_policy), full logits
    moe:       moe.enabled -> check the MoE layers' layout, join groups, no token dropping
    dtype:     model.to(config.dtype)
    load:      checkpoint -> full tensors sliced into this rank's shards
    inject:    replace_with_kernel_inject -> fused QKV / rotary + SDPA / gate-up MLP
    quantize:  quant.enabled -> shardspeed.inference.quantization.quantize_model
    place:     the accelerator's device unless keep_module_on_host
    return     InferenceEngine(model)
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from torch import nn

from shardspeed.inference.config import DeepSpeedInferenceConfig
from shardspeed.inference.engine import InferenceEngine

logger = logging.getLogger(__name__)


def init_inference(
    model: nn.Module, config: str | dict[str, Any] | None = None, **kwargs: Any
) -> InferenceEngine:
    """Prepare ``model`` for inference and return an :class:`InferenceEngine` around it.

    ``config``: DeepSpeed's inference config as a dict or a JSON file path; ``kwargs`` are
    the same keys and take precedence (DeepSpeed's merge rule). Collective over the tensor
    group when ``tensor_parallel.tp_size > 1`` (every rank calls it with the same model).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"init_inference(model=...): expected a torch.nn.Module, got {type(model)}")
    if isinstance(model, InferenceEngine):
        raise ValueError("init_inference: this model is already an InferenceEngine; pass .module.")
    cfg = build_config(config, kwargs)

    from shardspeed.inference.tensor_parallel import resolve_tp_group, shard_for_inference

    tp = cfg.tensor_parallel
    group = resolve_tp_group(cfg.tp_size, tp.tp_group, tp.mpu)
    if cfg.tp_size > 1:
        group = shard_for_inference(model, cfg.tp_size, group, cfg.injection_policy).group
    elif cfg.injection_policy is not None:
        logger.info("init_inference: injection_policy has nothing to split at tp_size 1.")
    if cfg.moe_config.enabled:  # shardspeed.moe layers over their expert group, no dropping
        from shardspeed.inference.moe_serving import prepare_moe_inference

        prepare_moe_inference(model, cfg.moe_config, cfg.tp_size)
    model.to(cfg.dtype)
    if cfg.checkpoint_source is not None:
        from shardspeed.inference.checkpoint import load_checkpoint

        load_checkpoint(model, cfg.checkpoint_source, cfg.checkpoint_base_dir)
    if cfg.replace_with_kernel_inject:
        from shardspeed.inference.injection import inject_fused_modules

        inject_fused_modules(model)
    if cfg.quant_enabled:
        from shardspeed.inference.quantization import config_from_deepspeed, quantize_model

        quant_config = config_from_deepspeed(cfg.quant)
        if quant_config is not None:
            model = quantize_model(model, quant_config)
    if not cfg.keep_module_on_host:
        from shardspeed.accelerator import get_accelerator

        accelerator = get_accelerator()
        if accelerator.is_available():
            model.to(accelerator.current_device_name())
    return InferenceEngine(model, cfg, group)


def build_config(
    config: str | dict[str, Any] | None, kwargs: dict[str, Any]
) -> DeepSpeedInferenceConfig:
    """Merge ``config`` (dict, JSON path, or a config object) with ``kwargs`` and validate."""
    if config is None:
        merged: dict[str, Any] = {}
    elif isinstance(config, DeepSpeedInferenceConfig):
        merged = {k: getattr(config, k) for k in config.model_fields_set}
    elif isinstance(config, (str, Path)):
        path = Path(config)
        if not path.is_file():
            raise ValueError(f"init_inference(config={str(config)!r}): no such JSON file.")
        merged = json.loads(path.read_text())
    elif isinstance(config, dict):
        merged = dict(config)
    else:
        raise TypeError(
            f"init_inference(config=...): expected a dict, a JSON file path or None, got "
            f"{type(config).__name__}."
        )
    merged.update(kwargs)
    return DeepSpeedInferenceConfig(**merged)
