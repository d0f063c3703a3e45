"""Weight-only int8 / int4 quantization for inference (``quantize_model``, ``pipeline(quantization=)``).

See ``docs/quantization.md``.
"""

from shardspeed.inference.quantization.config import WeightQuantConfig
from shardspeed.inference.quantization.deepspeed_config import config_from_deepspeed
from shardspeed.inference.quantization.linear import QuantizedLinear
from shardspeed.inference.quantization.qtensor import (
    QuantizedWeight,
    dequantize_weight,
    quantize_weight,
)
from shardspeed.inference.quantization.replace import quantize_model

__all__ = [
    "QuantizedLinear",
    "QuantizedWeight",
    "WeightQuantConfig",
    "config_from_deepspeed",
    "dequantize_weight",
    "quantize_model",
    "quantize_weight",
]
