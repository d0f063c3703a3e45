"""Precision blocks: ``fp16``, ``bf16`` (alias ``bfloat16``), ``data_types``, ``torch_autocast``.

Dtype names in the config are ``"fp32"``, ``"fp16"`` and ``"bf16"``; common spellings such as
``"float16"``, ``"half"``, ``"bfloat16"`` or ``"torch.float32"`` are normalised to them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BeforeValidator, Field, model_validator

from shardspeed.config.base import ConfigError, ConfigModel, Float, Int, explain

if TYPE_CHECKING:
    import torch

_DTYPE_SYNONYMS = {
    "fp32": "fp32",
    "float32": "fp32",
    "float": "fp32",
    "torch.float32": "fp32",
    "fp16": "fp16",
    "float16": "fp16",
    "half": "fp16",
    "torch.float16": "fp16",
    "bf16": "bf16",
    "bfloat16": "bf16",
    "torch.bfloat16": "bf16",
}


def normalize_dtype_name(value: Any) -> Any:
    """Map dtype spellings to ``"fp32"``/``"fp16"``/``"bf16"`` (others pass through unchanged)."""
    if isinstance(value, str):
        return _DTYPE_SYNONYMS.get(value.strip().lower(), value)
    try:
        import torch

        if isinstance(value, torch.dtype):
            return {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}.get(
                value, value
            )
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    return value


DTypeName = Annotated[Literal["fp32", "fp16", "bf16"], BeforeValidator(normalize_dtype_name)]
"""A dtype named in the config: ``"fp32"``, ``"fp16"`` or ``"bf16"``."""


def dtype_from_name(name: str | None) -> torch.dtype | None:
    """``"fp32"``/``"fp16"``/``"bf16"`` (or a synonym) -> ``torch.dtype``; None stays None."""
    if name is None:
        return None
    import torch

    table = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
    canonical = normalize_dtype_name(name)
    if canonical not in table:
        raise ConfigError(
            explain("unknown dtype name", name, allowed='"fp32", "fp16" or "bf16"', fix="use one")
        )
    return table[canonical]


class FP16Config(ConfigModel):
    """``fp16``: float16 mixed precision with a (dynamic) loss scaler."""

    json_key = "fp16"

    enabled: bool = Field(False, description="Train with fp16 parameters/compute.")
    auto_cast: bool = Field(False, description="Cast floating-point inputs of forward to fp16.")
    loss_scale: Float = Field(
        0.0, ge=0, description="Static loss scale; 0 selects dynamic loss scaling."
    )
    initial_scale_power: Int = Field(
        16, ge=0, description="Dynamic scaling starts at 2**initial_scale_power."
    )
    loss_scale_window: Int = Field(
        1000, ge=1, description="Clean steps (no overflow) before the dynamic scale doubles."
    )
    hysteresis: Int = Field(
        2, ge=1, description="Overflows tolerated before the dynamic scale is halved."
    )
    consecutive_hysteresis: bool = Field(
        False, description="Refill the hysteresis budget after every clean step."
    )
    min_loss_scale: Float = Field(1.0, gt=0, description="Lower bound of the dynamic loss scale.")
    fp16_master_weights_and_grads: bool = Field(
        False,
        description="Keep master weights and gradients in fp16 (ZeRO stages 1-3 with CPU Adam).",
    )

    @property
    def dynamic(self) -> bool:
        """True when the loss scale is dynamic (``loss_scale == 0``)."""
        return self.loss_scale == 0

    @property
    def initial_dynamic_scale(self) -> float:
        """The first dynamic loss scale, ``2 ** initial_scale_power``."""
        return float(2**self.initial_scale_power)


class BF16Config(ConfigModel):
    """``bf16`` (legacy spelling ``bfloat16``): bfloat16 mixed precision."""

    json_key = "bf16"

    enabled: bool = Field(False, description="Train with bf16 parameters/compute.")
    immediate_grad_update: bool = Field(
        False, description="Accumulate each gradient into the fp32 buffer as soon as it is ready."
    )
    check_grad_overflow: bool = Field(
        True, description="Check gradients for inf/nan and skip the step on overflow."
    )
    bf16_master_weights_and_grads: bool = Field(
        False, description="Keep master weights and gradients in bf16 (ZeRO stages 1-3)."
    )
    bf16_optimizer_states: bool = Field(
        False,
        description="Keep optimizer states in bf16 (requires bf16_master_weights_and_grads).",
    )

    @model_validator(mode="after")
    def _check_states(self) -> BF16Config:
        if self.bf16_optimizer_states and not self.bf16_master_weights_and_grads:
            raise ConfigError.at(
                "bf16_optimizer_states",
                explain(
                    "requires 'bf16_master_weights_and_grads': true",
                    True,
                    fix="set bf16.bf16_master_weights_and_grads to true or drop this key",
                ),
            )
        return self


class DataTypesConfig(ConfigModel):
    """``data_types``: dtypes of gradient accumulation, parameters and buffers."""

    json_key = "data_types"

    grad_accum_dtype: DTypeName | None = Field(
        None, description="Dtype of gradient accumulation buffers; None follows fp16/bf16."
    )
    param_dtype: DTypeName | None = Field(
        None, description="Dtype the model parameters are cast to; None follows fp16/bf16."
    )
    buffer_dtype: DTypeName | None = Field(
        None, description="Dtype of module buffers; None keeps buffers as loaded."
    )
    keep_in_fp32_modules: list[str] | None = Field(
        None,
        description='Module name patterns kept in fp32; None ("auto") uses the model\'s own list.',
    )


class TorchAutocastConfig(ConfigModel):
    """``torch_autocast``: run forward under ``torch.autocast`` instead of casting the model."""

    json_key = "torch_autocast"

    enabled: bool = Field(False, description="Wrap forward in torch.autocast.")
    dtype: DTypeName = Field("bf16", description="Lower-precision dtype used by autocast.")
    lower_precision_safe_modules: list[str] | None = Field(
        None, description="Module class paths whose parameters may be kept in low precision."
    )
