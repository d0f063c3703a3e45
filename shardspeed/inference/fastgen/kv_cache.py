"""Blocked KV cache tensors and their sizing.

Layout, per layer: ``k[layer]`` and ``v[layer]`` each ``[num_blocks, block_size,
num_kv_heads, head_dim]``. This is the paged layout FlashAttention's
``block_table`` argument reads directly, and viewed as ``[num_blocks *
block_size, num_kv_heads, head_dim]`` a token's *slot* ``block * block_size +
offset`` indexes it with one ``index_copy_`` / ``index_select``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardspeed.utils.logging import get_logger

logger = get_logger(__name__)


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape of the cache per block (everything except ``num_blocks``)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype  # compute dtype (and storage dtype when cache_dtype is "auto")
    cache_dtype: str = "auto"  # "int8" / "fp8": quantized storage (see kv_quant.py)

    @property
    def dtype_bytes(self) -> int:
        """Bytes of one stored K or V element (1 when quantized)."""
        if self.cache_dtype != "auto":
            return 1
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def bytes_per_block(self) -> int:
        """K and V of one block across all layers (with a quantized cache's fp16 scales:
        one per token and KV head)."""
        per_head = self.head_dim * self.dtype_bytes + (2 if self.cache_dtype != "auto" else 0)
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * per_head


# Default KV budget: this fraction of free memory, capped (see resolve_num_blocks).
DEFAULT_KV_FRACTION = {"cuda": 0.9, "cpu": 0.1}
CPU_KV_CAP_BYTES = 4 * 2**30  # as vLLM's default CPU KV space


def free_memory_bytes(device: torch.device) -> int:
    """Free device memory (CUDA) or available host memory (CPU: psutil, else /proc/meminfo)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        return int(psutil.virtual_memory().available)
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # the value is in kB
    raise RuntimeError(
        "cannot tell the available host memory (no psutil, no MemAvailable in /proc/meminfo); "
        "set EngineConfig.num_blocks or kv_cache_memory (bytes)."
    )


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / 2**30:.3f} GiB"


def resolve_num_blocks(
    spec: KVCacheSpec,
    device: torch.device,
    num_blocks: int | None,
    kv_cache_memory: int | float | None,
    max_useful_tokens: int,
) -> int:
    """Pick ``num_blocks``: explicit, from a byte budget, or from a fraction of free memory.

    A fraction (``kv_cache_memory`` float, default 0.9 of free CUDA memory or 0.1 of
    available host memory, the latter at most 4 GiB) is capped at the bytes of
    ``max_useful_tokens`` slots (every sequence at ``max_seq_len``): the cache never
    depends on ``max_position_embeddings`` alone. The arithmetic is logged in one line.
    """
    per_block = spec.bytes_per_block
    if num_blocks is not None:
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"EngineConfig.num_blocks={num_blocks!r} must be an int >= 1.")
        how = "num_blocks given"
    elif isinstance(kv_cache_memory, int) and not isinstance(kv_cache_memory, bool):
        if kv_cache_memory <= 0:
            raise ValueError(
                f"EngineConfig.kv_cache_memory={kv_cache_memory!r} must be a positive int "
                "(bytes) or a float fraction in (0, 1] of free memory."
            )
        num_blocks, how = kv_cache_memory // per_block, f"kv_cache_memory = {kv_cache_memory} B"
    else:
        if kv_cache_memory is None:
            frac = DEFAULT_KV_FRACTION["cuda" if device.type == "cuda" else "cpu"]
        elif isinstance(kv_cache_memory, float):
            frac = kv_cache_memory
            if not 0.0 < frac <= 1.0:
                raise ValueError(
                    f"EngineConfig.kv_cache_memory={kv_cache_memory} is a fraction outside "
                    "(0, 1]; pass a fraction like 0.5 or a byte count as an int."
                )
        else:
            raise ValueError(
                f"EngineConfig.kv_cache_memory={kv_cache_memory!r} must be a positive int (bytes) "
                "or a float fraction in (0, 1] of free memory."
            )
        free = free_memory_bytes(device)
        terms = [(frac * free, f"{frac:g} x {_gib(free)} free")]
        if device.type != "cuda" and kv_cache_memory is None:
            terms.append((CPU_KV_CAP_BYTES, f"CPU cap {_gib(CPU_KV_CAP_BYTES)}"))
        useful = -(-max_useful_tokens // spec.block_size) * per_block
        terms.append((useful, f"{max_useful_tokens} useful tokens = {_gib(useful)}"))
        budget, _ = min(terms)
        num_blocks = int(budget) // per_block
        how = f"budget = min({', '.join(t for _, t in terms)}) = {_gib(budget)}"
    if num_blocks < 1:
        raise ValueError(
            f"KV cache budget ({how}) is smaller than one block ({per_block} B); "
            "raise EngineConfig.kv_cache_memory or set num_blocks."
        )
    logger.info(
        "KV cache: %s; bytes per block = 2 * %d layers * %d block_size * %d kv_heads * "
        "%d head_dim * %d B (%s) = %d B -> num_blocks = %d = %s, %d token slots",
        how, spec.num_layers, spec.block_size, spec.num_kv_heads, spec.head_dim,
        spec.dtype_bytes,
        spec.cache_dtype + " + fp16 scales" if spec.cache_dtype != "auto"
        else str(spec.dtype).replace("torch.", ""),
        per_block, num_blocks,
        _gib(num_blocks * per_block), num_blocks * spec.block_size,
    )  # fmt: skip
    return num_blocks


class KVCache:
    """Per-layer K/V block tensors; slot ``s`` is ``(s // block_size, s % block_size)``."""

    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: torch.device):
        self.spec = spec
        self.num_blocks = num_blocks
        shape = (num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        # Zero-filled so padded (masked) gathers never read NaN garbage.
        self.k = [
            torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)
        ]
        self.v = [
            torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)
        ]

    def flat(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer`` as ``[num_slots, num_kv_heads, head_dim]`` views."""
        h, d = self.spec.num_kv_heads, self.spec.head_dim
        return self.k[layer].view(-1, h, d), self.v[layer].view(-1, h, d)

    def write(
        self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Store new tokens' ``k``/``v`` (``[N, num_kv_heads, head_dim]``) into their slots."""
        k_flat, v_flat = self.flat(layer)
        k_flat.index_copy_(0, slot_mapping, k.to(k_flat.dtype))
        v_flat.index_copy_(0, slot_mapping, v.to(v_flat.dtype))

    def copy_block(self, src: int, dst: int) -> None:
        """Copy block ``src``'s K/V (every layer) into block ``dst`` (forking a sequence)."""
        for layer in range(self.spec.num_layers):
            self.k[layer][dst].copy_(self.k[layer][src])
            self.v[layer][dst].copy_(self.v[layer][src])
