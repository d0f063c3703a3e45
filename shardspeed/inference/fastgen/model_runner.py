"""Runs one ragged forward of a scheduled batch and returns the logits rows needed.

Decode-only batches may take the compiled static-shape step of
:mod:`~shardspeed.inference.fastgen.compiled_decode` (``EngineConfig.compile_decode``);
everything else (prompt chunks, mixed batches) runs the eager ragged forward. With
tensor-parallel ``peers`` the batch goes to the workers first and the forward runs
in step with theirs (see :mod:`~shardspeed.inference.fastgen.tensor_parallel`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from shardspeed.inference.fastgen.compiled_decode import CompiledDecoder, unsupported_reason
from shardspeed.inference.fastgen.kv_cache import KVCache
from shardspeed.inference.fastgen.models import RaggedModel
from shardspeed.inference.fastgen.ragged import build_ragged_batch
from shardspeed.inference.fastgen.scheduler import ScheduledBatch
from shardspeed.utils.logging import get_logger

if TYPE_CHECKING:
    from shardspeed.inference.fastgen.lora import LoRAManager
    from shardspeed.inference.fastgen.tensor_parallel import TensorParallelPeers

logger = get_logger(__name__)

COMPILE_DECODE_CHOICES = (None, False, True, "compile", "cuda_graph")


def resolve_compile_decode(
    requested: bool | str | None, model: RaggedModel, device: torch.device
) -> str | None:
    """The compiled-decode mode to use (``"compile"``, ``"cuda_graph"``) or None for eager.

    ``None`` (auto) is eager today: on CPU the compiled step is faster per token but its
    one-off Inductor compile costs ~10 s (minutes on a loaded machine; see
    docs/inference.md), and the CUDA-graph path has not been measured on a GPU yet.
    ``True`` asks for the device's mode (CUDA graphs on CUDA, ``torch.compile`` on
    CPU) and raises when the model cannot take the path; ``False`` keeps eager.
    """
    if requested not in COMPILE_DECODE_CHOICES:
        raise ValueError(
            f"EngineConfig.compile_decode={requested!r} is not supported; choose one of "
            f"{COMPILE_DECODE_CHOICES} (None = auto, currently eager)."
        )
    if requested is None or requested is False:
        return None
    reason = unsupported_reason(model)
    if reason is not None:
        raise ValueError(
            f"EngineConfig.compile_decode={requested!r} but the model cannot take the compiled "
            f"decode path ({reason}); use compile_decode=False."
        )
    if requested is True:
        return "cuda_graph" if device.type == "cuda" else "compile"
    return requested


class ModelRunner:
    """Owns the model and its KV cache; ``execute`` = flatten, forward, return logits."""

    def __init__(
        self,
        model: RaggedModel,
        kv_cache: KVCache,
        device: torch.device,
        backend: str,
        compile_decode: bool | str | None = None,
        max_batch: int = 64,
        max_seq_len: int = 4096,
        peers: TensorParallelPeers | None = None,
    ):
        self.model = model
        self.peers = peers
        self.kv_cache = kv_cache
        self.device = device
        self.backend = backend
        self.block_size = kv_cache.spec.block_size
        mode = resolve_compile_decode(compile_decode, model, device)
        self.compiled: CompiledDecoder | None = None
        self.lora: LoRAManager | None = None  # set by the engine with enable_lora
        if mode is not None:
            self.compiled = CompiledDecoder(model, kv_cache, device, max_batch, max_seq_len, mode)
            logger.info("compiled decode: mode=%s, batch buckets %s", mode, self.compiled.buckets)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, keep_dtype: bool = False) -> torch.Tensor:
        """Logits ``[M, vocab]`` for the sequences with ``needs_logits``, in batch order: fp32,
        or (``keep_dtype``, for a caller that only takes each row's argmax) in the model's
        dtype, which saves converting ``M x vocab`` values each step."""
        if self.compiled is not None and self.compiled.accepts(batch):
            return _as_logits(self.compiled.run(batch), keep_dtype)
        if self.lora is not None:  # the forward adds each request's adapter delta
            with self.lora.scope(batch):
                return self._forward(batch, keep_dtype)
        return self._forward(batch, keep_dtype)

    def _forward(self, batch: ScheduledBatch, keep_dtype: bool) -> torch.Tensor:
        ragged = build_ragged_batch(batch, self.block_size, self.device, self.backend)
        if self.peers is not None:
            logits = self.peers.execute(batch, lambda: self.model(ragged, self.kv_cache))
            return _as_logits(logits, keep_dtype)
        return _as_logits(self.model(ragged, self.kv_cache), keep_dtype)


def _as_logits(logits: torch.Tensor, keep_dtype: bool) -> torch.Tensor:
    return logits if keep_dtype else logits.float()
