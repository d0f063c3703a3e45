"""``tensor_parallel`` (AutoTP training), ``hybrid_engine`` (train + generate) and ``moe`` blocks."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from shardspeed.config.base import ConfigModel, Int
from shardspeed.config.precision import DTypeName


class TPConfig(ConfigModel):
    """``tensor_parallel.tp``: the tensor-parallel group."""

    json_key = "tensor_parallel.tp"

    tp_size: Int = Field(1, ge=1, description="Ranks a layer is split across.")
    tp_grain_size: Int = Field(1, ge=1, description="Granularity of uneven MLP/lm_head splits.")


class TensorParallelConfig(ConfigModel):
    """``tensor_parallel``: automatic tensor parallelism for training (AutoTP)."""

    json_key = "tensor_parallel"
    key_aliases = {"tensor_parallel": "tp", "kernel_inject": "replace_with_kernel_inject"}

    autotp_size: Int = Field(0, ge=0, description="AutoTP degree; 0 disables AutoTP training.")
    tp_overlap_comm: bool = Field(
        False, description="Overlap the row-parallel all-reduce with computation."
    )
    dtype: DTypeName | None = Field(
        None, description="Dtype the model is converted to; None follows fp16/bf16."
    )
    tp: TPConfig = Field(default_factory=TPConfig, description="Tensor-parallel group options.")
    partition_config: dict[str, Any] | None = Field(
        None, description="Custom layer partitioning rules (layer_specs with name patterns)."
    )
    preset_model: str | None = Field(
        None, description='Built-in partitioning preset, e.g. "llama", "qwen2", "mixtral".'
    )
    keep_module_on_host: bool = Field(
        False, description="Keep loaded checkpoint tensors on the host until sharded."
    )
    replace_with_kernel_inject: bool = Field(
        False, description="Inject fused inference kernels (inference only)."
    )


class HybridEngineConfig(ConfigModel):
    """``hybrid_engine``: switch one engine between training and generation (RLHF)."""

    json_key = "hybrid_engine"

    enabled: bool = Field(False, description="Build the hybrid (train + generate) engine.")
    max_out_tokens: Int = Field(512, gt=0, description="Generation workspace size in tokens.")
    inference_tp_size: Int = Field(1, ge=1, description="Tensor-parallel degree for generation.")
    release_inference_cache: bool = Field(
        False, description="Free the generation KV cache after each generate call."
    )
    pin_parameters: bool = Field(True, description="Pin gathered parameters during generation.")
    tp_gather_partition_size: Int = Field(
        8, ge=1, description="Layers gathered at once when switching to generation."
    )
    enable_cuda_graph: bool = Field(False, description="Capture generation in CUDA graphs.")


class MoEConfig(ConfigModel):
    """``moe``: ShardSpeed's options for MoE training (DeepSpeed has no such block)."""

    json_key = "moe"

    grad_norm: Literal["deepspeed", "global"] = Field(
        "deepspeed",
        description="Clipping norm with expert groups: 'deepspeed' reproduces DeepSpeed 0.19.8 "
        "(at ZeRO 0 the data ranks' own norms averaged, below the true norm), 'global' the "
        "true global norm at every stage.",
    )
