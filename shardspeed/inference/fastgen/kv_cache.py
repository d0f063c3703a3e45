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
    dtype: torch.dtype

    @property
    def dtype_bytes(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def bytes_per_block(self) -> int:
        """K and V of one block across all layers."""
        return (
            2
            * self.num_layers
            * self.block_size
            * self.num_kv_heads
            * self.head_dim
            * self.dtype_bytes
        )


def free_memory_bytes(device: torch.device) -> int:
    """Free device memory (CUDA) or available host memory (CPU, via psutil)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    import psutil

    return int(psutil.virtual_memory().available)


def resolve_num_blocks(
    spec: KVCacheSpec,
    device: torch.device,
    num_blocks: int | None,
    kv_cache_memory: int | float | None,
    default_tokens: int,
) -> int:
    """Pick ``num_blocks``: explicit, from a byte/fraction budget, or a default.

    The default holds ``default_tokens`` token slots, capped at 90% of free CUDA
    memory or 25% of available host memory. The arithmetic is logged in one line.
    """
    per_block = spec.bytes_per_block
    how = ""
    if num_blocks is not None:
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"EngineConfig.num_blocks={num_blocks!r} must be an int >= 1.")
        how = "num_blocks given"
    else:
        if kv_cache_memory is None:
            frac = 0.9 if device.type == "cuda" else 0.25
            cap = int(free_memory_bytes(device) * frac)
            want = -(-default_tokens // spec.block_size) * per_block
            budget, how = (
                min(cap, want),
                (
                    f"default: {default_tokens} tokens, capped at {frac:.0%} of free memory ({cap} B)"
                ),
            )
        elif isinstance(kv_cache_memory, float) and not isinstance(kv_cache_memory, bool):
            if not 0.0 < kv_cache_memory <= 1.0:
                raise ValueError(
                    f"EngineConfig.kv_cache_memory={kv_cache_memory} is a fraction outside (0, 1]; "
                    "pass a fraction like 0.5 or a byte count as an int."
                )
            free = free_memory_bytes(device)
            budget, how = int(free * kv_cache_memory), f"{kv_cache_memory} x free {free} B"
        elif isinstance(kv_cache_memory, int) and kv_cache_memory > 0:
            budget, how = kv_cache_memory, "kv_cache_memory bytes"
        else:
            raise ValueError(
                f"EngineConfig.kv_cache_memory={kv_cache_memory!r} must be a positive int (bytes) "
                "or a float fraction in (0, 1] of free memory."
            )
        num_blocks = budget // per_block
        if num_blocks < 1:
            raise ValueError(
                f"KV cache budget {budget} B ({how}) is smaller than one block ({per_block} B); "
                "raise EngineConfig.kv_cache_memory or set num_blocks."
            )
    logger.info(
        "KV cache: bytes per block = 2 * %d layers * %d block_size * %d kv_heads * %d head_dim * "
        "%d B (%s) = %d B; num_blocks = %d (%s) -> %.1f MiB, %d token slots",
        spec.num_layers, spec.block_size, spec.num_kv_heads, spec.head_dim, spec.dtype_bytes,
        str(spec.dtype).replace("torch.", ""), per_block, num_blocks, how,
        num_blocks * per_block / 2**20, num_blocks * spec.block_size,
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
