"""Builders of DeepSpeed ops that ShardSpeed does not implement.

Each is importable under DeepSpeed's name so that code probing for an op
(``TransformerBuilder().is_compatible()``) gets a plain False, and ``load()`` raises
:class:`~shardspeed.ops.op_builder.builder.OpNotAvailableError` naming the op, what it
does in DeepSpeed and what to use with ShardSpeed instead.
"""

from __future__ import annotations

from shardspeed.ops.op_builder.builder import UnavailableOpBuilder

_OWN_MODULES = (
    "ShardSpeed runs the model's own PyTorch modules (torch SDPA, torch.compile); there is "
    "no kernel injection."
)
_FASTGEN = (
    "ShardSpeed's FastGen engine (shardspeed.inference.fastgen) runs ragged batches with "
    "PyTorch kernels and needs no compiled op."
)
_COMM = (
    "ShardSpeed's collectives go through torch.distributed (gloo on CPU, NCCL on CUDA) via "
    "shardspeed.comm."
)


class TransformerBuilder(UnavailableOpBuilder):
    """DeepSpeed's fused transformer-layer training kernels (``DeepSpeedTransformerLayer``)."""

    BUILD_VAR = "DS_BUILD_TRANSFORMER"
    NAME = "transformer"
    ABSOLUTE_NAME = "deepspeed.ops.transformer.transformer_op"
    WHAT = "the fused transformer-layer training kernels (DeepSpeedTransformerLayer)"
    INSTEAD = _OWN_MODULES


class StochasticTransformerBuilder(TransformerBuilder):
    """The stochastic-mode variant of :class:`TransformerBuilder`."""

    BUILD_VAR = "DS_BUILD_STOCHASTIC_TRANSFORMER"
    NAME = "stochastic_transformer"
    ABSOLUTE_NAME = "deepspeed.ops.transformer.stochastic_transformer_op"
    WHAT = "the stochastic fused transformer-layer training kernels"


class InferenceBuilder(UnavailableOpBuilder):
    """Kernel-injection inference kernels (``replace_with_kernel_inject``)."""

    BUILD_VAR = "DS_BUILD_TRANSFORMER_INFERENCE"
    NAME = "transformer_inference"
    ABSOLUTE_NAME = "deepspeed.ops.transformer.inference.transformer_inference_op"
    WHAT = "the kernel-injection inference kernels (replace_with_kernel_inject)"
    INSTEAD = _OWN_MODULES


class QuantizerBuilder(UnavailableOpBuilder):
    """Integer quantization kernels (MoQ, ZeRO++ quantized communication)."""

    BUILD_VAR = "DS_BUILD_QUANTIZER"
    NAME = "quantizer"
    ABSOLUTE_NAME = "deepspeed.ops.quantizer.quantizer_op"
    WHAT = "the CUDA integer quantization kernels"
    INSTEAD = "Quantize with torch.ao.quantization or a library such as bitsandbytes."


class FPQuantizerBuilder(UnavailableOpBuilder):
    """FP8/FP6/FP4 quantization kernels."""

    BUILD_VAR = "DS_BUILD_FP_QUANTIZER"
    NAME = "fp_quantizer"
    ABSOLUTE_NAME = "deepspeed.ops.fp_quantizer.fp_quantizer_op"
    WHAT = "the floating-point (FP8/FP6/FP4) quantization kernels"
    INSTEAD = "Cast with torch's float8 dtypes (torch.float8_e4m3fn) or use torchao."


class RandomLTDBuilder(UnavailableOpBuilder):
    """Random layer-token-drop gather/scatter kernels."""

    BUILD_VAR = "DS_BUILD_RANDOM_LTD"
    NAME = "random_ltd"
    ABSOLUTE_NAME = "deepspeed.ops.random_ltd_op"
    WHAT = "random layer-token drop (data_efficiency.data_routing.random_ltd)"
    INSTEAD = "Remove data_routing.random_ltd from the config; train on every token."


class EvoformerAttnBuilder(UnavailableOpBuilder):
    """DeepSpeed4Science Evoformer attention (CUTLASS)."""

    BUILD_VAR = "DS_BUILD_EVOFORMER_ATTN"
    NAME = "evoformer_attn"
    ABSOLUTE_NAME = "deepspeed.ops.evoformer_attn_op"
    WHAT = "the Evoformer attention kernels (DS4Sci_EvoformerAttention)"
    INSTEAD = "Use torch.nn.functional.scaled_dot_product_attention with an additive bias."


class RaggedUtilsBuilder(UnavailableOpBuilder):
    """Host-side helpers of DeepSpeed-FastGen's ragged batches."""

    BUILD_VAR = "DS_BUILD_RAGGED_OPS"
    NAME = "ragged_ops"
    ABSOLUTE_NAME = "deepspeed.inference.v2.ragged_ops"
    WHAT = "DeepSpeed-FastGen's compiled ragged-batch helpers"
    INSTEAD = _FASTGEN


class RaggedOpsBuilder(UnavailableOpBuilder):
    """Device kernels of DeepSpeed-FastGen's ragged batches."""

    BUILD_VAR = "DS_BUILD_RAGGED_DEVICE_OPS"
    NAME = "ragged_device_ops"
    ABSOLUTE_NAME = "deepspeed.inference.v2.kernels.ragged_ops.ragged_device_ops"
    WHAT = "DeepSpeed-FastGen's ragged-batch device kernels"
    INSTEAD = _FASTGEN


class InferenceCoreBuilder(UnavailableOpBuilder):
    """DeepSpeed-FastGen's core inference kernels."""

    BUILD_VAR = "DS_BUILD_INFERENCE_CORE_OPS"
    NAME = "inference_core_ops"
    ABSOLUTE_NAME = "deepspeed.inference.v2.kernels.inference_core_ops"
    WHAT = "DeepSpeed-FastGen's core inference kernels"
    INSTEAD = _FASTGEN


class InferenceCutlassBuilder(UnavailableOpBuilder):
    """DeepSpeed-FastGen's CUTLASS GEMM kernels."""

    BUILD_VAR = "DS_BUILD_CUTLASS_OPS"
    NAME = "cutlass_ops"
    ABSOLUTE_NAME = "deepspeed.inference.v2.kernels.cutlass_ops.cutlass_ops"
    WHAT = "DeepSpeed-FastGen's CUTLASS GEMM kernels"
    INSTEAD = _FASTGEN


class SpatialInferenceBuilder(UnavailableOpBuilder):
    """Diffusion-model (spatial) inference kernels."""

    BUILD_VAR = "DS_BUILD_SPATIAL_INFERENCE"
    NAME = "spatial_inference"
    ABSOLUTE_NAME = "deepspeed.ops.spatial.spatial_inference_op"
    WHAT = "the spatial (diffusion UNet/VAE) inference kernels"
    INSTEAD = _OWN_MODULES


class CCLCommBuilder(UnavailableOpBuilder):
    """oneCCL collectives for CPU training."""

    BUILD_VAR = "DS_BUILD_CCL_COMM"
    NAME = "deepspeed_ccl_comm"
    ABSOLUTE_NAME = "deepspeed.ops.comm.deepspeed_ccl_comm_op"
    WHAT = "the oneCCL communication op"
    INSTEAD = _COMM


class ShareMemCommBuilder(UnavailableOpBuilder):
    """Shared-memory collectives between ranks of one CPU host."""

    BUILD_VAR = "DS_BUILD_SHM_COMM"
    NAME = "deepspeed_shm_comm"
    ABSOLUTE_NAME = "deepspeed.ops.comm.deepspeed_shm_comm_op"
    WHAT = "the shared-memory communication op"
    INSTEAD = _COMM


class DeepCompileBuilder(UnavailableOpBuilder):
    """DeepCompile's runtime op."""

    BUILD_VAR = "DS_BUILD_DEEP_COMPILE"
    NAME = "dc"
    ABSOLUTE_NAME = "deepspeed.ops.dc_op"
    WHAT = "DeepCompile (compile.deepcompile)"
    INSTEAD = "Use torch.compile on the model."


class PinMemoryBuilder(UnavailableOpBuilder):
    """Pinned host-memory allocation op."""

    BUILD_VAR = "DS_BUILD_PIN_MEMORY"
    NAME = "pin_memory"
    ABSOLUTE_NAME = "deepspeed.ops.pin_memory.pin_memory_op"
    WHAT = "the pinned-memory op"
    INSTEAD = "Use get_accelerator().pin_memory(tensor) or tensor.pin_memory()."


class NotImplementedBuilder(UnavailableOpBuilder):
    """DeepSpeed's placeholder for an op the accelerator lacks."""

    BUILD_VAR = "DS_BUILD_NOT_IMPLEMENTED"
    NAME = "deepspeed_not_implemented"
    ABSOLUTE_NAME = "deepspeed.ops.comm.deepspeed_not_implemented_op"
    WHAT = "this op on this accelerator"
    INSTEAD = "Pick an op that is_compatible() reports as available."
