"""The ``compression_training`` block of the ds_config, typed.

Seven techniques share one shape (DeepSpeed 0.19.6's layout)::

    "compression_training": {
      "weight_quantization": {
        "shared_parameters": {"enabled": true, "schedule_offset": 0, ...},
        "different_groups": {
          "wq1": {"params": {"start_bits": 8, "target_bits": 4, "quantization_period": 10},
                  "modules": ["attention.self", "intermediate"]}}},
      "head_pruning": {..., "different_groups": {"hp1": {
          "params": {"dense_ratio": 0.5},
          "modules": ["attention.output.dense"],
          "related_modules": [["self.query", "self.key", "self.value"]]}}},
      "layer_reduction": {"enabled": true, "keep_number_layer": 2, ...}
    }

``shared_parameters`` apply to every group of a technique; each group adds its ``params`` and
names modules by pattern (:mod:`shardspeed.compression.matching`). Every key is either acted
on or refused by name: unknown keys get a "did you mean"; DeepSpeed keys that ShardSpeed does
not implement (the CUDA ``quantizer_kernel``, the neural-compressor ``snip_momentum`` method
and its options) are refused with the fix.
"""

from __future__ import annotations

import json
import os
from typing import Any, Literal

from pydantic import ConfigDict, Field, model_validator

from shardspeed.config.base import ConfigError, ConfigModel, Float, Int, explain, show

WEIGHT_QUANTIZATION = "weight_quantization"
ACTIVATION_QUANTIZATION = "activation_quantization"
SPARSE_PRUNING = "sparse_pruning"
ROW_PRUNING = "row_pruning"
HEAD_PRUNING = "head_pruning"
CHANNEL_PRUNING = "channel_pruning"
LAYER_REDUCTION = "layer_reduction"

TECHNIQUES = (
    WEIGHT_QUANTIZATION,
    ACTIVATION_QUANTIZATION,
    SPARSE_PRUNING,
    ROW_PRUNING,
    HEAD_PRUNING,
    CHANNEL_PRUNING,
)
"""The module-level techniques, in the order ``init_compression`` attaches them (the order
of DeepSpeed's global-RNG draws); ``redundancy_clean`` folds them in the same order."""

QuantType = Literal["symmetric", "asymmetric"]
PruneMethod = Literal["l1", "topk"]


class _Block(ConfigModel):
    """A ``compression_training`` block: each field's docstring is its description."""

    model_config = ConfigDict(**ConfigModel.model_config, use_attribute_docstrings=True)


def _dense_ratio_ok(value: float, key: str = "dense_ratio") -> float:
    if not 0.0 < value <= 1.0:
        raise ConfigError.at(
            key,
            explain(
                "is the fraction of weights kept",
                value,
                "0 < dense_ratio <= 1",
                "e.g. 0.5 keeps half",
            ),
        )
    return value


# -- per-group blocks ----------------------------------------------------------------------


class GroupScope(_Block):
    """Which modules a group covers (shared by every technique's group)."""

    modules: list[str]
    """Module-name patterns: Python regular expressions searched (``re.search``) in each
    compressible module's dotted name; a lone ``"*"`` matches every compressible module."""

    related_modules: list[list[str]] | None = None
    """For row / head / channel pruning: per entry of ``modules``, the patterns of the
    modules whose *input* dimension shrinks with it (row pruning: the next layer; head
    pruning: the output projection's q/k/v). With them, ``redundancy_clean`` removes pruned
    rows/heads/channels; without, it only zeroes them."""

    @model_validator(mode="after")
    def _related_match_modules(self) -> GroupScope:
        if self.related_modules is not None and len(self.related_modules) != len(self.modules):
            raise ConfigError.at(
                "related_modules",
                explain(
                    "needs one list of patterns per entry of 'modules' "
                    f"({len(self.modules)} modules, {len(self.related_modules)} lists)",
                    self.related_modules,
                    fix="give one inner list per module pattern, in the same order",
                ),
            )
        return self


class WeightQuantizationParams(_Block):
    """A weight-quantization group: the bit schedule."""

    start_bits: Int = Field(ge=1, le=16)
    """Bits at the first quantized step."""
    target_bits: Int = Field(ge=1, le=16)
    """Final bits (2 = ternary, 1 = binary)."""
    quantization_period: Int = Field(default=1, ge=0)
    """Steps before the first one-bit drop; the period doubles after every drop (MoQ)."""

    @model_validator(mode="after")
    def _target_below_start(self) -> WeightQuantizationParams:
        if self.target_bits > self.start_bits:
            raise ConfigError.at(
                "target_bits",
                explain(
                    "must not exceed start_bits (the schedule only lowers bits)",
                    self.target_bits,
                    f"1..{self.start_bits}",
                    "swap start_bits and target_bits",
                ),
            )
        return self


class WeightQuantizationGroup(GroupScope):
    params: WeightQuantizationParams


class ActivationQuantizationParams(_Block):
    bits: Literal[4, 8]
    """Activation bits."""


class ActivationQuantizationGroup(GroupScope):
    params: ActivationQuantizationParams


class PruningParams(_Block):
    dense_ratio: Float
    """Fraction kept (0.5 keeps half the weights / rows / heads / channels)."""

    @model_validator(mode="after")
    def _ratio(self) -> PruningParams:
        _dense_ratio_ok(self.dense_ratio)
        return self


class PruningGroup(GroupScope):
    params: PruningParams


# -- shared parameters -----------------------------------------------------------------------


class FP16MixedQuantize(_Block):
    """MoQ's blend of the float and quantized weight right after each bit drop."""

    enabled: bool = False
    """Switch this technique (or option) on."""
    quantize_change_ratio: Float = Field(default=0.001, ge=0.0, le=1.0)
    """How much the float share shrinks per quantization step."""


class WeightQuantizationShared(_Block):
    enabled: bool = False
    """Switch this technique (or option) on."""
    quantizer_kernel: bool = False
    """DeepSpeed's CUDA quantizer kernel: refused (ShardSpeed quantizes in PyTorch)."""
    schedule_offset: Int = Field(default=0, ge=0)
    """Optimizer step at which the technique starts acting."""
    quantize_groups: Int = Field(default=1, ge=1)
    """Number of scales per weight (the weight is split into this many equal groups)."""
    quantize_verbose: bool = False
    """Log each bit drop."""
    quantization_type: QuantType = "symmetric"
    """'symmetric' (scale only) or 'asymmetric' (scale and zero point)."""
    quantize_weight_in_forward: bool = False
    """True: quantize in each forward (straight-through gradient, float master weights).
    False: quantize the weights in place after each optimizer step (MoQ)."""
    rounding: Literal["nearest", "stochastic"] = "nearest"
    """'nearest' or 'stochastic' rounding of quantized weights."""
    fp16_mixed_quantize: FP16MixedQuantize = FP16MixedQuantize()
    """MoQ's blend of float and quantized weights after each bit drop."""

    @model_validator(mode="after")
    def _refuse_kernel(self) -> WeightQuantizationShared:
        if self.quantizer_kernel:
            raise ConfigError.at(
                "quantizer_kernel",
                explain(
                    "DeepSpeed's CUDA quantizer kernel is not implemented; ShardSpeed "
                    "quantizes with PyTorch ops (same levels)",
                    True,
                    "false",
                    "set quantizer_kernel to false or remove it",
                ),
            )
        return self


class ActivationQuantizationShared(_Block):
    enabled: bool = False
    """Switch this technique (or option) on."""
    quantization_type: QuantType = "symmetric"
    """'symmetric' (scale only) or 'asymmetric' (scale and zero point)."""
    range_calibration: Literal["dynamic", "static"] = "dynamic"
    """dynamic: per-token range at each call; static: a running min/max (momentum 0.95)
    learned in training and frozen in eval."""
    schedule_offset: Int = Field(default=1000, ge=0)
    """Optimizer step at which the technique starts acting."""


_SNIP_ONLY = ("block_pattern", "schedule_offset_stride", "excluded_modules", "dense_ratio")


class SparsePruningShared(_Block):
    enabled: bool = False
    """Switch this technique (or option) on."""
    method: PruneMethod = "l1"
    """l1: mask fixed from |w| at init; topk: mask from learned scores."""
    schedule_offset: Int = Field(default=1000, ge=0)
    """Optimizer step at which the technique starts acting."""
    schedule_offset_end: Int | None = Field(default=None, ge=0)
    """Last step at which pruning may switch on (default: no limit). Once on, the mask stays."""

    @model_validator(mode="before")
    @classmethod
    def _refuse_snip(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        if data.get("method") == "snip_momentum":
            raise ConfigError.at(
                "method",
                explain(
                    "snip_momentum needs Intel neural-compressor's pruners and is not implemented",
                    "snip_momentum",
                    '"l1" or "topk"',
                    'use "l1" (magnitude) or "topk" (learned scores)',
                ),
            )
        for key in _SNIP_ONLY:
            if key in data:
                where = "different_groups.<name>.params" if key == "dense_ratio" else None
                fix = f"move it to {where}" if where else "remove it"
                raise ConfigError.at(
                    key,
                    explain(
                        "is read only by the snip_momentum method, which ShardSpeed does not "
                        "implement",
                        data[key],
                        fix=fix,
                    ),
                )
        return data

    @model_validator(mode="after")
    def _end_after_start(self) -> SparsePruningShared:
        end = self.schedule_offset_end
        if end is not None and end < self.schedule_offset:
            raise ConfigError.at(
                "schedule_offset_end",
                explain(
                    "must not be before schedule_offset",
                    end,
                    f">= {self.schedule_offset}",
                    "raise it or remove it",
                ),
            )
        return self


class RowPruningShared(_Block):
    enabled: bool = False
    """Switch this technique (or option) on."""
    method: PruneMethod = "l1"
    """How elements are ranked for pruning: 'l1' (magnitude) or 'topk' (learned scores)."""
    schedule_offset: Int = Field(default=1000, ge=0)
    """Optimizer step at which the technique starts acting."""


class HeadPruningShared(_Block):
    enabled: bool = False
    """Switch this technique (or option) on."""
    method: Literal["topk"] = "topk"
    """Only topk (learned head scores): DeepSpeed lists l1 but its layer cannot run it."""
    schedule_offset: Int = Field(default=1000, ge=0)
    """Optimizer step at which the technique starts acting."""
    num_heads: Int | None = Field(default=None, ge=1)
    """Attention heads of each pruned output projection (required when enabled)."""

    @model_validator(mode="before")
    @classmethod
    def _refuse_l1(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("method") == "l1":
            raise ConfigError.at(
                "method",
                explain(
                    "head pruning by l1 norm is not implemented (DeepSpeed 0.19.6's layer "
                    "raises NotImplementedError too)",
                    "l1",
                    '"topk"',
                    'use "topk"',
                ),
            )
        return data

    @model_validator(mode="after")
    def _num_heads_when_enabled(self) -> HeadPruningShared:
        if self.enabled and self.num_heads is None:
            raise ConfigError.at(
                "num_heads",
                explain(
                    "is required when head pruning is enabled",
                    fix="set num_heads to the attention head count",
                ),
            )
        return self


class ChannelPruningShared(_Block):
    enabled: bool = False
    """Switch this technique (or option) on."""
    method: PruneMethod = "l1"
    """How elements are ranked for pruning: 'l1' (magnitude) or 'topk' (learned scores)."""
    schedule_offset: Int = Field(default=1000, ge=0)
    """Optimizer step at which the technique starts acting."""


# -- techniques --------------------------------------------------------------------------------


class _Technique(_Block):
    """A technique block: ``shared_parameters`` plus named ``different_groups``."""

    @model_validator(mode="before")
    @classmethod
    def _groups_when_enabled(cls, data: Any) -> Any:
        if isinstance(data, dict):
            shared = data.get("shared_parameters") or {}
            if isinstance(shared, dict) and shared.get("enabled") is True:
                if not data.get("different_groups"):
                    raise ConfigError.at(
                        "different_groups",
                        explain(
                            "is required when the technique is enabled",
                            fix='add "different_groups": {"<name>": {"params": {...}, '
                            '"modules": [...]}}',
                        ),
                    )
        return data


class WeightQuantization(_Technique):
    shared_parameters: WeightQuantizationShared = WeightQuantizationShared()
    """Settings shared by every group of this technique."""
    different_groups: dict[str, WeightQuantizationGroup] = {}
    """Named groups: each has its own params and the module-name patterns it covers."""

    @model_validator(mode="after")
    def _low_bits_rules(self) -> WeightQuantization:
        shared = self.shared_parameters
        for name, group in self.different_groups.items():
            if group.params.target_bits > 2:
                continue
            if shared.quantization_type != "symmetric":
                raise ConfigError.at(
                    "shared_parameters.quantization_type",
                    explain(
                        f"group '{name}' quantizes to {group.params.target_bits} bit(s); "
                        "binary and ternary weights are symmetric only",
                        shared.quantization_type,
                        '"symmetric"',
                        'set quantization_type to "symmetric"',
                    ),
                )
            if shared.rounding != "nearest":
                raise ConfigError.at(
                    "shared_parameters.rounding",
                    explain(
                        f"group '{name}' quantizes to {group.params.target_bits} bit(s); "
                        "binary and ternary weights round to nearest only",
                        shared.rounding,
                        '"nearest"',
                        'set rounding to "nearest"',
                    ),
                )
        return self


class ActivationQuantization(_Technique):
    shared_parameters: ActivationQuantizationShared = ActivationQuantizationShared()
    """Settings shared by every group of this technique."""
    different_groups: dict[str, ActivationQuantizationGroup] = {}
    """Named groups: each has its own params and the module-name patterns it covers."""


class SparsePruning(_Technique):
    shared_parameters: SparsePruningShared = SparsePruningShared()
    """Settings shared by every group of this technique."""
    different_groups: dict[str, PruningGroup] = {}
    """Named groups: each has its own params and the module-name patterns it covers."""


class RowPruning(_Technique):
    shared_parameters: RowPruningShared = RowPruningShared()
    """Settings shared by every group of this technique."""
    different_groups: dict[str, PruningGroup] = {}
    """Named groups: each has its own params and the module-name patterns it covers."""


class HeadPruning(_Technique):
    shared_parameters: HeadPruningShared = HeadPruningShared()
    """Settings shared by every group of this technique."""
    different_groups: dict[str, PruningGroup] = {}
    """Named groups: each has its own params and the module-name patterns it covers."""


class ChannelPruning(_Technique):
    shared_parameters: ChannelPruningShared = ChannelPruningShared()
    """Settings shared by every group of this technique."""
    different_groups: dict[str, PruningGroup] = {}
    """Named groups: each has its own params and the module-name patterns it covers."""


class LayerReduction(_Block):
    """Initialise a shallower student from chosen teacher layers (knowledge distillation)."""

    enabled: bool = False
    """Switch this technique (or option) on."""
    keep_number_layer: Int | None = Field(default=None, ge=1)
    """Student layers; must equal ``len(teacher_layer)`` when given."""
    module_name_prefix: str = ""
    """Dotted name of the layer list, e.g. ``bert.encoder.layer`` or ``transformer.h``."""
    teacher_layer: list[Int] = []
    """Teacher layer copied into student layer i, e.g. ``[1, 3, 5]``."""
    other_module_name: list[str] = []
    """Other modules copied whole (embeddings, pooler, head)."""

    @model_validator(mode="after")
    def _complete_when_enabled(self) -> LayerReduction:
        if not self.enabled:
            return self
        if not self.module_name_prefix:
            raise ConfigError.at(
                "module_name_prefix",
                explain(
                    "is required when layer reduction is enabled",
                    fix='set it to the layer list, e.g. "bert.encoder.layer"',
                ),
            )
        if not self.teacher_layer:
            raise ConfigError.at(
                "teacher_layer",
                explain(
                    "is required when layer reduction is enabled",
                    fix="list the teacher layer for each student layer, e.g. [1, 3]",
                ),
            )
        keep = self.keep_number_layer
        if keep is not None and keep != len(self.teacher_layer):
            raise ConfigError.at(
                "keep_number_layer",
                explain(
                    f"must equal the number of teacher_layer entries ({len(self.teacher_layer)})",
                    keep,
                    str(len(self.teacher_layer)),
                    "make the two agree",
                ),
            )
        return self


class CompressionConfig(_Block):
    """The ``compression_training`` block (every technique defaults to off)."""

    json_key = "compression_training"

    weight_quantization: WeightQuantization = WeightQuantization()
    """Quantization-aware training of weights (bit schedule, groups)."""
    activation_quantization: ActivationQuantization = ActivationQuantization()
    """Quantization of layer inputs (static or dynamic range)."""
    sparse_pruning: SparsePruning = SparsePruning()
    """Unstructured pruning of weight elements."""
    row_pruning: RowPruning = RowPruning()
    """Structured pruning of output rows (and the matching inputs of related layers)."""
    head_pruning: HeadPruning = HeadPruning()
    """Structured pruning of attention heads (output projection and its q/k/v)."""
    channel_pruning: ChannelPruning = ChannelPruning()
    """Structured pruning of convolution output channels."""
    layer_reduction: LayerReduction = LayerReduction()
    """Keep a subset of the layers, initialised from chosen teacher layers."""

    def technique(self, name: str) -> Any:
        """The block of one technique of :data:`TECHNIQUES`."""
        return getattr(self, name)

    def enabled_techniques(self) -> list[str]:
        """Names of the enabled module-level techniques, in :data:`TECHNIQUES` order."""
        return [t for t in TECHNIQUES if self.technique(t).shared_parameters.enabled]


def _refuse_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ConfigError.at(key, explain("appears twice in the JSON file", fix="keep one"))
        out[key] = value
    return out


def get_compression_config(deepspeed_config: Any) -> CompressionConfig:
    """Parse the ``compression_training`` block of a ds_config.

    Args:
        deepspeed_config: the ds_config as a dict, a path to its JSON file, or an already
            parsed :class:`CompressionConfig`. A dict without ``compression_training``
            gives the all-off default.

    Raises:
        ValueError: the argument is neither a dict nor an existing file.
        ConfigError: a key of the block is wrong (named with its JSON path).
    """
    if isinstance(deepspeed_config, CompressionConfig):
        return deepspeed_config
    if isinstance(deepspeed_config, (str, os.PathLike)):
        if not os.path.exists(deepspeed_config):
            raise ValueError(
                f"deepspeed_config: no such file {show(str(deepspeed_config))}; pass the "
                "ds_config as a dict or the path of an existing JSON file."
            )
        with open(deepspeed_config) as f:
            deepspeed_config = json.load(f, object_pairs_hook=_refuse_duplicate_keys)
    if not isinstance(deepspeed_config, dict):
        raise ValueError(
            f"deepspeed_config: expected a dict or a JSON file path, got "
            f"{type(deepspeed_config).__name__}; pass the ds_config dict."
        )
    block = deepspeed_config.get("compression_training") or {}
    return CompressionConfig.model_validate(block)
