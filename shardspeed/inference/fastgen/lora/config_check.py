"""Validation of ``EngineConfig``'s LoRA fields and what they cannot be combined with."""

from __future__ import annotations

from typing import Any

# (field, values LoRA works with, why not the others)
_INCOMPATIBLE = (
    ("tensor_parallel", (1,), "adapters are not sharded across ranks yet"),
    ("pipeline_parallel", (1,), "adapters are not split across stages yet"),
    ("expert_parallel", (1,), "the per-rank engines do not carry adapters yet"),
    ("compile_decode", (None, False), "the compiled step does not run the LoRA hooks"),
    ("speculative_config", (None,), "draft / verify forwards do not carry adapters yet"),
)


def check_lora_config(config: Any) -> None:
    """``ValueError`` naming the field for a bad ``max_loras`` / ``max_lora_rank`` /
    ``enable_lora`` or a combination LoRA does not support."""
    if not isinstance(config.enable_lora, bool):
        raise ValueError(f"EngineConfig.enable_lora={config.enable_lora!r} must be True or False.")
    for name in ("max_loras", "max_lora_rank"):
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"EngineConfig.{name}={value!r} must be an int >= 1.")
    if not config.enable_lora:
        return
    for name, ok, why in _INCOMPATIBLE:
        value = getattr(config, name, ok[0])
        if value not in ok:
            raise ValueError(
                f"EngineConfig.enable_lora=True cannot be combined with {name}={value!r} "
                f"({why}); use {name}={ok[0]!r} or serve without LoRA."
            )
