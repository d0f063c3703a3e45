"""``init_inference``'s config: DeepSpeed's ``DeepSpeedInferenceConfig`` keys, typed.

Every key DeepSpeed 0.19.8 accepts is a field here (with DeepSpeed's aliases: ``tp``,
``kernel_inject``, ``max_tokens``, ``min_tokens``, ``tm``, ``injection_dict``, ``args``,
``ckpt_config``; the deprecated ``mp_size`` / ``mpu`` move into ``tensor_parallel``). Each is
either acted on by :func:`~shardspeed.inference.init.init_inference` or refused here with a
message that says why and what to use instead; the two pure tuning knobs with no effect
here (``tensor_parallel.tp_grain_size``, ``replace_method``) are accepted with one warning.
Unknown keys fail with a "did you mean" hint (the shared :class:`ConfigModel` behaviour).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from pydantic import Field, PrivateAttr, field_validator, model_validator

from shardspeed.config.base import ConfigError, ConfigModel, Int, explain, one_of
from shardspeed.utils.logging import warning_once

logger = logging.getLogger(__name__)

_DTYPES: dict[str, torch.dtype] = {
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "torch.float16": torch.float16,
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
    "torch.float32": torch.float32,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "bfloat": torch.bfloat16,
    "torch.bfloat16": torch.bfloat16,
}  # fmt: skip
_SUPPORTED_DTYPES = (torch.float16, torch.float32, torch.bfloat16)


class InferenceTPConfig(ConfigModel):
    """``tensor_parallel``: split the model's layers over ranks (AutoTP)."""

    json_key = "tensor_parallel"

    enabled: bool = Field(True, description="False forces tp_size 1.")
    tp_size: Int = Field(1, ge=1, description="Ranks each layer is split across.")
    tp_grain_size: Int = Field(
        64, ge=1, description="DeepSpeed's MLP/lm_head split granularity (no effect here)."
    )
    mpu: Any = Field(None, description="Object with get_model_parallel_group() (the TP group).")
    tp_group: Any = Field(None, description="The tensor-parallel process group to use.")

    @field_validator("tp_grain_size")
    @classmethod
    def _grain(cls, value: int) -> int:
        if value != 64:
            warning_once(
                f"init_inference: tensor_parallel.tp_grain_size={value} has no effect: AutoTP "
                "splits MLP and lm_head features near-evenly per element (results are unchanged)."
            )
        return value


def _is_int8(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("int8", "torch.int8")
    return value is torch.int8


class DeepSpeedInferenceConfig(ConfigModel):
    """DeepSpeed's inference config (``deepspeed.init_inference(model, config, **kwargs)``)."""

    json_key = ""
    key_aliases = {
        "kernel_inject": "replace_with_kernel_inject",
        "tp": "tensor_parallel",
        "tm": "triangular_masking",
        "injection_dict": "injection_policy",
        "max_tokens": "max_out_tokens",
        "min_tokens": "min_out_tokens",
        "args": "config",
        "ckpt_config": "checkpoint_config",
        "expert_group": "ep_group",
        "expert_mp_group": "ep_mp_group",
    }

    replace_with_kernel_inject: bool = Field(
        False, description="Swap attention/MLP for fused modules (fused QKV, SDPA, gate/up)."
    )
    dtype: Any = Field(torch.float16, description="Model dtype (DeepSpeed's default: fp16).")
    tensor_parallel: InferenceTPConfig = Field(default_factory=InferenceTPConfig)
    enable_cuda_graph: bool = Field(False, description="Refused: no CUDA-graph capture here.")
    use_triton: bool = Field(False, description="Refused when true: no Triton kernels.")
    triton_autotune: bool = Field(False, description="Refused when true: no Triton kernels.")
    zero: dict[str, Any] = Field(default_factory=dict, description="Refused: ZeRO-Inference.")
    triangular_masking: bool = Field(True, description="Causal attention (False is refused).")
    moe: bool | dict[str, Any] = Field(
        default_factory=dict, description="Expert-parallel serving of shardspeed.moe layers."
    )
    keep_module_on_host: bool = Field(False, description="Do not move the model to the device.")
    quant: dict[str, Any] = Field(default_factory=dict, description="Weight quantization block.")
    checkpoint: str | dict[str, Any] | None = Field(
        None, description="State-dict file(s) to load: a path, a JSON descriptor, or a dict."
    )
    base_dir: str = Field("", description="Directory the checkpoint's file names are under.")
    set_empty_params: bool = Field(False, description="Refused when true.")
    save_mp_checkpoint_path: str | None = Field(None, description="Refused when set.")
    checkpoint_config: dict[str, Any] = Field(
        default_factory=dict, description="checkpoint_dir / base_dir (save path refused)."
    )
    return_tuple: bool = Field(True, description="Layers keep HF's return type (False refused).")
    training_mp_size: Int = Field(1, ge=1, description="Checkpoint's TP degree; only 1 (full).")
    replace_method: str = Field("auto", description="Deprecated, ignored with a warning.")
    injection_policy: dict[Any, Any] | None = Field(
        None, description="{module class: (names of row-parallel output linears,)}."
    )
    injection_policy_tuple: Any = Field(None, description="DeepSpeed-internal; refused.")
    config: dict[str, Any] | None = Field(None, description="Refused: model.config is used.")
    max_out_tokens: Int = Field(1024, gt=0, description="Max prompt + generated tokens.")
    min_out_tokens: Int = Field(1, ge=0, description="Tokens generate must leave room for.")
    transposed_mode: bool = Field(False, description="Refused when true (kernel layout).")
    mp_size: Int | None = Field(None, ge=1, description="Deprecated tensor_parallel.tp_size.")
    mpu: Any = Field(None, description="Deprecated tensor_parallel.mpu.")
    ep_size: Int = Field(1, ge=1, description="Deprecated moe.ep_size.")
    ep_group: Any = Field(None, description="Deprecated moe.ep_group (refused when set).")
    ep_mp_group: Any = Field(None, description="Deprecated moe.ep_mp_group (refused when set).")
    moe_experts: list[int] = Field(
        default_factory=lambda: [1], description="Deprecated moe.moe_experts."
    )
    moe_type: str = Field("standard", description="Deprecated moe.type.")
    _moe: Any = PrivateAttr(None)  # the resolved moe block (see moe_config)

    @field_validator("dtype", mode="before")
    @classmethod
    def _dtype(cls, value: Any) -> torch.dtype:
        if isinstance(value, str) and value.strip().lower() in _DTYPES:
            return _DTYPES[value.strip().lower()]
        if isinstance(value, torch.dtype) and value in _SUPPORTED_DTYPES:
            return value
        raise ValueError(
            explain(
                "unsupported dtype", str(value),
                one_of(["torch.float16", "torch.bfloat16", "torch.float32", "fp16", "bf16", "fp32"]),
            )
        )  # fmt: skip

    @model_validator(mode="before")
    @classmethod
    def _int8_dtype(cls, data: Any) -> Any:
        """``dtype=torch.int8`` (DeepSpeed's switch for int8 inference): int8 weights, fp16
        compute, as DeepSpeed's kernels run them. It becomes ``dtype=torch.float16`` plus an
        int8 weight-quantization ``quant`` block (symmetric, one scale per output channel,
        DeepSpeed's default grouping); a ``quant`` block given alongside must ask for 8 bits."""
        if not isinstance(data, dict) or not _is_int8(data.get("dtype")):
            return data
        quant = dict(data.get("quant") or {})
        weight = dict(quant.get("weight") or {})
        if weight.get("num_bits", 8) != 8 or not quant.get("enabled", True):
            raise ConfigError.at(
                "quant",
                explain(
                    "contradicts dtype=torch.int8, which asks for int8 weights", quant,
                    fix="drop dtype=torch.int8 (keep fp16/bf16) or make quant ask for 8 bits",
                ),
            )  # fmt: skip
        weight.setdefault("num_bits", 8)
        quant.update(enabled=True, weight=weight)
        logger.info("init_inference: dtype=torch.int8 -> int8 weights, fp16 compute (as DeepSpeed)")
        return {**data, "dtype": torch.float16, "quant": quant}

    @model_validator(mode="before")
    @classmethod
    def _deprecated_tp(cls, data: Any) -> Any:
        """``mp_size`` / ``mpu`` (deprecated) become ``tensor_parallel.tp_size`` / ``.mpu``."""
        if not isinstance(data, dict):
            return data
        if "tp" in data and "tensor_parallel" in data:
            raise ConfigError.at(
                "tp", explain("is an alias of 'tensor_parallel'; both were given", fix="keep one")
            )
        tp = data.get("tensor_parallel", data.get("tp", {}))
        if isinstance(tp, ConfigModel):
            tp = tp.model_dump()
        tp = dict(tp) if isinstance(tp, dict) else tp
        for old, new in (("mp_size", "tp_size"), ("mpu", "mpu")):
            value = data.get(old)
            if value is None or not isinstance(tp, dict):
                continue
            if old == "mp_size" and value == 1:
                continue
            if new in tp and tp[new] is not None and tp[new] != value and tp[new] != 1:
                raise ConfigError.at(
                    old,
                    explain(
                        f"conflicts with tensor_parallel.{new}={tp[new]!r}", value,
                        fix=f"keep only tensor_parallel.{new} ({old} is deprecated)",
                    ),
                )  # fmt: skip
            warning_once(f"init_inference: '{old}' is deprecated; use 'tensor_parallel.{new}'.")
            tp[new] = value
        if "tp" in data:
            data = {k: v for k, v in data.items() if k != "tp"}
        if tp != {} or "tensor_parallel" in data:
            data["tensor_parallel"] = tp
        return data

    @model_validator(mode="after")
    def _refusals(self) -> DeepSpeedInferenceConfig:
        for key, bad, why in self._refused():
            if bad:
                raise ConfigError.at(key, why)
        from shardspeed.inference.moe_config import resolve_moe_config

        self._moe = resolve_moe_config(self)  # ConfigError on a bad moe block
        if self.min_out_tokens > self.max_out_tokens:
            raise ConfigError.at(
                "min_out_tokens",
                explain(
                    f"is larger than max_out_tokens={self.max_out_tokens}", self.min_out_tokens,
                    fix="raise max_out_tokens or lower min_out_tokens",
                ),
            )  # fmt: skip
        if self.injection_policy is not None and self.replace_with_kernel_inject:
            raise ConfigError.at(
                "injection_policy",
                explain(
                    "cannot be combined with replace_with_kernel_inject=True (injection_policy "
                    "names AutoTP's row-parallel layers; kernel injection uses the built-in "
                    "Llama/Mistral/Qwen2 modules)",
                    fix="drop one of the two",
                ),
            )
        if self.replace_method != "auto":
            warning_once(
                f"init_inference: replace_method={self.replace_method!r} is deprecated and has no "
                "effect (the modules to replace are found automatically); remove it."
            )
        return self

    def _refused(self) -> list[tuple[str, bool, str]]:
        zero_on = bool(self.zero) and self.zero != {"stage": 0}
        return [
            ("enable_cuda_graph", self.enable_cuda_graph, explain(
                "CUDA-graph capture is not supported by ShardSpeed's init_inference (on CPU "
                "there are no CUDA graphs; on CUDA the HF generate loop's dynamic KV cache "
                "cannot be captured)", True,
                fix="remove it; for lower launch overhead on CUDA wrap engine.module with "
                "torch.compile(mode='reduce-overhead') yourself")),
            ("use_triton", self.use_triton, explain(
                "ShardSpeed ships no Triton inference kernels", True,
                fix="remove it; replace_with_kernel_inject=True uses fused PyTorch modules")),
            ("triton_autotune", self.triton_autotune, explain(
                "ShardSpeed ships no Triton inference kernels", True, fix="remove it")),
            ("zero", zero_on, explain(
                "ZeRO-Inference is not part of init_inference", self.zero,
                fix="use shardspeed.inference.pipeline(model, offload={'device': 'cpu'}) to "
                "stream weights from host memory")),
            ("triangular_masking", not self.triangular_masking, explain(
                "only causal (triangular) attention is supported: the wrapped causal LM's "
                "outputs would change otherwise", False, fix="remove it")),
            ("set_empty_params", self.set_empty_params, explain(
                "empty (meta) module creation is not supported", True,
                fix="build the model normally; checkpoint tensors are sliced per rank at load")),
            ("save_mp_checkpoint_path", self.save_mp_checkpoint_path is not None, explain(
                "saving a pre-sharded checkpoint is not supported", self.save_mp_checkpoint_path,
                fix="load the full checkpoint with 'checkpoint' (sliced at load) instead")),
            ("checkpoint_config", bool(set(self.checkpoint_config) - {"checkpoint_dir",
                                                                     "base_dir"}) or bool(
                self.checkpoint_config.get("save_mp_checkpoint_path")), explain(
                "only checkpoint_dir and base_dir are supported", self.checkpoint_config)),
            ("return_tuple", not self.return_tuple, explain(
                "kernel-injected modules keep each Hugging Face layer's own return type", False,
                fix="remove it")),
            ("training_mp_size", self.training_mp_size != 1, explain(
                "checkpoints must hold full (unsharded) tensors; they are sliced per rank at "
                "load", self.training_mp_size, fix="merge the model-parallel shards first")),
            ("injection_policy_tuple", self.injection_policy_tuple is not None, explain(
                "is DeepSpeed-internal", fix="pass injection_policy instead")),
            ("config", self.config is not None, explain(
                "is not used: the model's own config (model.config) describes it",
                fix="remove it")),
            ("transposed_mode", self.transposed_mode, explain(
                "is a DeepSpeed kernel weight layout with no meaning here", True,
                fix="remove it")),
        ]  # fmt: skip

    @property
    def moe_config(self) -> Any:
        """The ``moe`` block (deprecated top-level keys merged in) as an
        :class:`~shardspeed.inference.moe_config.InferenceMoEConfig`."""
        return self._moe

    @property
    def tp_size(self) -> int:
        """The tensor-parallel degree in effect (1 when ``tensor_parallel.enabled`` is false)."""
        return self.tensor_parallel.tp_size if self.tensor_parallel.enabled else 1

    @property
    def quant_enabled(self) -> bool:
        """A ``quant`` block was given and is enabled (DeepSpeed's default once given)."""
        return bool(self.quant) and bool(self.quant.get("enabled", True))

    @property
    def checkpoint_source(self) -> str | dict[str, Any] | None:
        """``checkpoint``, or ``checkpoint_config.checkpoint_dir``."""
        return self.checkpoint or self.checkpoint_config.get("checkpoint_dir")

    @property
    def checkpoint_base_dir(self) -> str:
        return self.base_dir or self.checkpoint_config.get("base_dir", "") or ""
