"""Quantized KV cache: int8 (or fp8 e4m3) values with one fp16 scale per token and KV head.

``EngineConfig.kv_cache_dtype="int8"`` stores each new token's K and V as
``round(x / s)`` in int8 with ``s = max|x| / 127`` over the head's ``head_dim`` values
(``"fp8"``: ``x / s`` in ``float8_e4m3fn`` with ``s = max|x| / 448``). A slot costs
``head_dim + 2`` bytes per head instead of ``2 * head_dim`` in bf16 (``4 * head_dim`` in
fp32): for ``head_dim`` 64, 1.94x the tokens of a bf16 cache and 3.88x of fp32 in the
same memory. Scales per token (not per block) need no re-quantization when a block
fills up over several decode steps, and an outlier token does not coarsen its block.

Attention reads whole blocks: ``k[layer][block_ids]`` returns them dequantized in the
compute dtype (``_DequantizedBlocks``), so the torch attention path is unchanged. The
compiled decode step and FlashAttention read the raw tensors and are refused with it.
"""

from __future__ import annotations

import torch

from shardspeed.inference.fastgen.kv_cache import KVCache, KVCacheSpec

KV_CACHE_DTYPES = ("auto", "int8", "fp8")
SCALE_DTYPE = torch.float16
_QMAX = {"int8": 127.0, "fp8": 448.0}
_MIN_SCALE = 1e-7  # a head of all zeros keeps a representable scale


def storage_dtype(kv_cache_dtype: str) -> torch.dtype:
    """The element dtype of a quantized cache (``"int8"`` -> int8, ``"fp8"`` -> e4m3; fp8
    bytes are kept in a uint8 tensor since CPU ``index_copy_`` lacks float8 kernels)."""
    if kv_cache_dtype == "int8":
        return torch.int8
    if kv_cache_dtype == "fp8":
        if not hasattr(torch, "float8_e4m3fn"):
            raise ValueError(
                "EngineConfig.kv_cache_dtype='fp8' needs torch.float8_e4m3fn, which this torch "
                f"build ({torch.__version__}) lacks; use kv_cache_dtype='int8'."
            )
        return torch.float8_e4m3fn
    raise ValueError(
        f"EngineConfig.kv_cache_dtype={kv_cache_dtype!r} is not supported; choose one of "
        f"{KV_CACHE_DTYPES}."
    )


def quantize(x: torch.Tensor, kv_cache_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (``[N, H, D]``) -> (values ``[N, H, D]`` in the storage dtype, scales ``[N, H]``
    fp16). Dividing by the fp16-rounded scale keeps quantize and dequantize consistent."""
    qmax = _QMAX[kv_cache_dtype]
    amax = x.detach().float().abs().amax(dim=-1)  # [N, H]
    scale = (amax / qmax).clamp(min=_MIN_SCALE).to(SCALE_DTYPE)  # [N, H]
    scaled = x.float() / scale.float().unsqueeze(-1)  # [N, H, D] in [-qmax, qmax]
    if kv_cache_dtype == "int8":
        values = scaled.round().clamp(-qmax, qmax).to(torch.int8)
    else:
        values = scaled.clamp(-qmax, qmax).to(torch.float8_e4m3fn)
    return values, scale


def dequantize(values: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``values`` (``[..., H, D]``; uint8 holds fp8 bytes) times ``scale`` (``[..., H]``),
    in ``dtype``."""
    if values.dtype == torch.uint8:
        values = values.view(torch.float8_e4m3fn)
    return (values.float() * scale.float().unsqueeze(-1)).to(dtype)


class _DequantizedBlocks:
    """One layer's K (or V) blocks, indexed like the plain cache tensor
    ``[num_blocks, block_size, H_kv, D]`` but returning dequantized copies."""

    def __init__(self, values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> None:
        self.values = values  # [num_blocks, BS, H_kv, D] int8 / fp8
        self.scales = scales  # [num_blocks, BS, H_kv] fp16
        self.dtype = dtype
        self.shape = values.shape

    def __getitem__(self, index: torch.Tensor | int) -> torch.Tensor:
        return dequantize(self.values[index], self.scales[index], self.dtype)


class QuantizedKVCache(KVCache):
    """:class:`KVCache` with int8 / fp8 values and per-token-head fp16 scales."""

    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: torch.device):
        self.spec = spec
        self.num_blocks = num_blocks
        store = storage_dtype(spec.cache_dtype)
        store = torch.uint8 if store != torch.int8 else store  # fp8 bytes (see storage_dtype)
        shape = (num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        layers = range(spec.num_layers)
        self.k_values = [torch.zeros(shape, dtype=store, device=device) for _ in layers]
        self.v_values = [torch.zeros(shape, dtype=store, device=device) for _ in layers]
        self.k_scales = [torch.ones(shape[:3], dtype=SCALE_DTYPE, device=device) for _ in layers]
        self.v_scales = [torch.ones(shape[:3], dtype=SCALE_DTYPE, device=device) for _ in layers]
        self.k = [
            _DequantizedBlocks(q, s, spec.dtype) for q, s in zip(self.k_values, self.k_scales)
        ]
        self.v = [
            _DequantizedBlocks(q, s, spec.dtype) for q, s in zip(self.v_values, self.v_scales)
        ]

    def flat(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError(
            "a quantized KV cache has no flat compute-dtype view; read blocks through k/v"
        )

    def write(
        self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Quantize the new tokens' ``k``/``v`` (``[N, H_kv, D]``) into their slots."""
        h, d = self.spec.num_kv_heads, self.spec.head_dim
        for new, values, scales in (
            (k, self.k_values[layer], self.k_scales[layer]),
            (v, self.v_values[layer], self.v_scales[layer]),
        ):
            q, s = quantize(new, self.spec.cache_dtype)
            values.view(-1, h, d).index_copy_(0, slot_mapping, q.view(values.dtype))
            scales.view(-1, h).index_copy_(0, slot_mapping, s)

    def copy_block(self, src: int, dst: int) -> None:
        for tensors in (self.k_values, self.v_values, self.k_scales, self.v_scales):
            for t in tensors:
                t[dst].copy_(t[src])


def make_kv_cache(spec: KVCacheSpec, num_blocks: int, device: torch.device) -> KVCache:
    """A plain cache in ``spec.dtype``, or a quantized one for ``spec.cache_dtype`` int8 / fp8."""
    if spec.cache_dtype == "auto":
        return KVCache(spec, num_blocks, device)
    return QuantizedKVCache(spec, num_blocks, device)
