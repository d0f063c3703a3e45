"""Runs one ragged forward of a scheduled batch and returns the logits rows needed."""

from __future__ import annotations

import torch

from shardspeed.inference.fastgen.kv_cache import KVCache
from shardspeed.inference.fastgen.models import RaggedModel
from shardspeed.inference.fastgen.ragged import build_ragged_batch
from shardspeed.inference.fastgen.scheduler import ScheduledBatch


class ModelRunner:
    """Owns the model and its KV cache; ``execute`` = flatten, forward, return logits."""

    def __init__(self, model: RaggedModel, kv_cache: KVCache, device: torch.device, backend: str):
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        self.backend = backend
        self.block_size = kv_cache.spec.block_size

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> torch.Tensor:
        """Logits ``[M, vocab]`` (fp32) for the sequences with ``needs_logits``, in batch order."""
        ragged = build_ragged_batch(batch, self.block_size, self.device, self.backend)
        return self.model(ragged, self.kv_cache).float()
