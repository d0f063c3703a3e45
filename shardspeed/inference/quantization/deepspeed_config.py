"""Map DeepSpeed's quantization config blocks onto :class:`WeightQuantConfig`.

Two DeepSpeed forms are understood:

1. the ``init_inference`` ``quant`` block::

       {"enabled": true,
        "weight": {"num_bits": 8, "q_groups": 1, "q_type": "symmetric"},
        "activation": {"enabled": false},
        "qkv": {"enabled": true}}

   ``num_bits`` -> ``bits``; ``q_type`` -> ``symmetric``. DeepSpeed's ``q_groups`` is how
   many scale groups one weight matrix is cut into (1 = a single scale). ShardSpeed
   always quantizes at least per output channel (int8) or per 32-128 input columns
   (int4, group size 128 unless ``weight.group_size`` says otherwise), which is at
   least ``q_groups`` groups for any ``q_groups <= out_features``; finer groups only
   lower the error. ``qkv.enabled: false`` keeps the attention input projections
   in full precision. Activation quantization is refused (weight-only here).

2. the ds_config ``weight_quantization`` block (``post_init_quant`` form)::

       {"post_init_quant": {"fc": {"num_bits": 4, "group_size": 64,
                                   "group_dim": 1, "symmetric": false}, ...}}

   Each key is a substring of the module names it applies to; those keys become
   ``WeightQuantConfig.modules``. Groups run along the input dimension
   (``group_dim`` 1 of the ``(out, in)`` weight); all keys must share one setting.
"""

from __future__ import annotations

import logging
from typing import Any

from shardspeed.inference.quantization.config import WeightQuantConfig

logger = logging.getLogger(__name__)

# attention input projections across the model families we load (HF and ragged names)
QKV_PATTERNS = (
    "*q_proj", "*k_proj", "*v_proj", "*qkv_proj", "*c_attn", "*query_key_value", "*Wqkv",
)  # fmt: skip

_QUANT_KEYS = {"enabled", "weight", "activation", "qkv"}
_WEIGHT_KEYS = {"enabled", "num_bits", "q_type", "q_groups", "group_size", "post_init_quant"}
_POST_INIT_KEYS = {"num_bits", "group_size", "group_dim", "symmetric"}


def _check_keys(block: dict[str, Any], allowed: set[str], where: str) -> None:
    unknown = sorted(set(block) - allowed)
    if unknown:
        raise ValueError(f"unknown key(s) {unknown} in {where}; allowed keys: {sorted(allowed)}.")


def _bits(value: Any, where: str) -> int:
    if isinstance(value, bool) or value not in (4, 8):
        raise ValueError(f"{where}.num_bits={value!r} is not supported; use 8 or 4.")
    return int(value)


def config_from_deepspeed(block: dict[str, Any]) -> WeightQuantConfig | None:
    """A :class:`WeightQuantConfig` from a DeepSpeed ``quant`` or ``weight_quantization`` block.

    ``block`` may also be a whole config holding one of them under ``"quant"`` or
    ``"weight_quantization"``. Returns None when the block disables quantization
    (``enabled: false``). Raises ``ValueError`` naming the key for anything that
    cannot be honoured (activation quantization, ``group_dim`` 0, mixed per-module
    settings, ZeRO-3 ``quantized_initialization``).
    """
    if not isinstance(block, dict):
        raise TypeError(f"config_from_deepspeed expects a dict, got {type(block).__name__}.")
    if "quant" in block:
        return _from_quant_block(block["quant"])
    if "weight_quantization" in block:
        return _from_weight_quantization(block["weight_quantization"])
    if "post_init_quant" in block or "quantized_initialization" in block:
        return _from_weight_quantization(block)
    return _from_quant_block(block)


def _from_quant_block(block: dict[str, Any]) -> WeightQuantConfig | None:
    _check_keys(block, _QUANT_KEYS, "quant")
    if not block.get("enabled", True):
        return None
    activation = block.get("activation") or {}
    if activation.get("enabled", False):
        raise ValueError(
            "quant.activation.enabled=True: ShardSpeed quantizes weights only (activations "
            "stay in fp32/bf16/fp16); set quant.activation.enabled to false or drop the key."
        )
    weight = dict(block.get("weight") or {})
    _check_keys(weight, _WEIGHT_KEYS, "quant.weight")
    if not weight.get("enabled", True):
        return None
    if weight.get("post_init_quant"):
        return _from_weight_quantization({"post_init_quant": weight["post_init_quant"]})
    bits = _bits(weight.get("num_bits", 8), "quant.weight")
    q_type = weight.get("q_type", "symmetric")
    if q_type not in ("symmetric", "asymmetric"):
        raise ValueError(
            f"quant.weight.q_type={q_type!r} is not supported; use 'symmetric' or 'asymmetric'."
        )
    q_groups = weight.get("q_groups", 1)
    if isinstance(q_groups, bool) or not isinstance(q_groups, int) or q_groups < 1:
        raise ValueError(f"quant.weight.q_groups={q_groups!r} must be an int >= 1.")
    skip = WeightQuantConfig().skip_modules
    if not (block.get("qkv") or {}).get("enabled", True):
        skip = (*skip, *QKV_PATTERNS)
    config = WeightQuantConfig(
        bits=bits,
        group_size=weight.get("group_size"),
        symmetric=q_type == "symmetric",
        skip_modules=skip,
    )
    logger.info(
        "quant block -> %s (q_groups=%d is met: groups are per channel or per %s columns)",
        config, q_groups, config.effective_group_size,
    )  # fmt: skip
    return config


def _from_weight_quantization(block: dict[str, Any]) -> WeightQuantConfig | None:
    _check_keys(block, {"post_init_quant", "quantized_initialization"}, "weight_quantization")
    if block.get("quantized_initialization"):
        raise ValueError(
            "weight_quantization.quantized_initialization (ZeRO-3 quantized init) is not "
            "supported; use weight_quantization.post_init_quant, which quantizes after load."
        )
    per_key = block.get("post_init_quant") or {}
    if not isinstance(per_key, dict):
        raise ValueError(
            "weight_quantization.post_init_quant must map module-name keys to settings, e.g. "
            f"{{'fc': {{'num_bits': 4, 'group_size': 64, 'group_dim': 1}}}}; got {per_key!r}."
        )
    if not per_key:
        return None
    settings = set()
    for key, setting in per_key.items():
        where = f"weight_quantization.post_init_quant[{key!r}]"
        if not isinstance(setting, dict):
            raise ValueError(f"{where} must be a dict of settings, got {setting!r}.")
        _check_keys(setting, _POST_INIT_KEYS, where)
        if setting.get("group_dim", 1) != 1:
            raise ValueError(
                f"{where}.group_dim={setting['group_dim']!r}: only group_dim=1 (groups along "
                "the input dimension of the (out, in) weight) is supported."
            )
        bits = _bits(setting.get("num_bits", 8), where)
        settings.add((bits, setting.get("group_size"), bool(setting.get("symmetric", False))))
    if len(settings) > 1:
        raise ValueError(
            "weight_quantization.post_init_quant gives different settings per key "
            f"{sorted(settings, key=str)}; ShardSpeed applies one setting per model - use the "
            "same num_bits/group_size/symmetric for every key."
        )
    bits, group_size, symmetric = settings.pop()
    return WeightQuantConfig(
        bits=bits,
        group_size=group_size,
        symmetric=symmetric,
        modules=tuple(per_key),
    )
