"""``replace_with_kernel_inject``: swap a model's attention and MLP modules for fused ones.

Supported: the Llama family as Hugging Face implements it (``llama``, ``mistral``,
``qwen2``), sharded or not. Each attention module (``q_proj``/``k_proj``/``v_proj``/
``o_proj``) becomes a :class:`~.attention.FusedAttention` and each gated MLP
(``gate_proj``/``up_proj``/``down_proj``/``act_fn``) a :class:`~.fused_mlp.FusedGatedMLP`, in place.
Other model types are refused: their attention differs (GPT-2's learned positions and
Conv1D layout, Qwen3's q/k norms, ...) and a silently partial injection would hide that.
"""

from __future__ import annotations

import logging

from torch import nn

from shardspeed.inference.injection.attention import FusedAttention
from shardspeed.inference.injection.fused_mlp import FusedGatedMLP

logger = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
_ATTENTION_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP_PARTS = ("gate_proj", "up_proj", "down_proj", "act_fn")


def inject_fused_modules(model: nn.Module) -> dict[str, int]:
    """Replace attention and MLP modules in place; returns how many of each were swapped."""
    config = getattr(model, "config", None)
    model_type = str(getattr(config, "model_type", "")).lower()
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"replace_with_kernel_inject=True supports model types {list(SUPPORTED_MODEL_TYPES)}, "
            f"got {model_type or type(model).__name__!r}; pass replace_with_kernel_inject=False "
            "(tensor parallelism works for it without fused modules)."
        )
    if getattr(config, "_attn_implementation", "sdpa") not in ("sdpa", "eager"):
        config._attn_implementation = "sdpa"  # HF then builds masks SDPA can take
    swapped = {"attention": 0, "mlp": 0}
    for name, module in list(model.named_modules()):
        if isinstance(module, (FusedAttention, FusedGatedMLP)):
            continue
        if all(hasattr(module, p) for p in _ATTENTION_PARTS) and hasattr(module, "layer_idx"):
            _replace(model, name, FusedAttention(module))
            swapped["attention"] += 1
        elif all(hasattr(module, p) for p in _MLP_PARTS):
            mlp = FusedGatedMLP(module.gate_proj, module.up_proj, module.down_proj, module.act_fn)
            _replace(model, name, mlp)
            swapped["mlp"] += 1
    num_layers = getattr(config, "num_hidden_layers", None)
    if num_layers is not None and swapped != {"attention": num_layers, "mlp": num_layers}:
        raise ValueError(
            f"kernel injection swapped {swapped} modules but the model has {num_layers} layers; "
            "its modules do not follow the Llama layout (q/k/v/o_proj, gate/up/down_proj)."
        )
    logger.info("kernel injection: %s", swapped)
    return swapped


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
