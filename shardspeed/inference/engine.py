"""``deepspeed.inference.engine.InferenceEngine``: the module ``init_inference`` returns.

A thin ``nn.Module`` around the (sharded, possibly kernel-injected) model: ``forward`` and
``generate`` call the wrapped model's own, so results are the Hugging Face model's. What it
adds is the config's limits (``max_out_tokens``, ``min_out_tokens``) and, with tensor
parallelism, one shared sampling seed per ``generate`` call so every tensor rank draws the
same tokens (their logits are identical; their random streams need not be).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from shardspeed import comm
from shardspeed.inference.config import DeepSpeedInferenceConfig

logger = logging.getLogger(__name__)


def _is_token_ids(value: Any) -> bool:
    """An integer tensor of token ids (not embeddings)."""
    return isinstance(value, torch.Tensor) and not value.is_floating_point()


class InferenceEngine(nn.Module):
    """The wrapped model (``.module``) with DeepSpeed's inference-engine interface."""

    def __init__(
        self, model: nn.Module, config: DeepSpeedInferenceConfig, tp_group: Any = None
    ) -> None:
        super().__init__()
        self.module = model
        self._config = config
        self.mp_group = tp_group
        self.mp_world_size = config.tp_size
        self.injected = config.replace_with_kernel_inject
        self.module.eval()
        self.training = False

    @property
    def config(self) -> DeepSpeedInferenceConfig:
        """The validated inference config."""
        return self._config

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """The wrapped model's forward (sequence length checked against ``max_out_tokens``)."""
        ids = kwargs.get("input_ids", inputs[0] if inputs else None)
        if _is_token_ids(ids) and ids.dim() >= 2:
            self._check_tokens(ids.shape[-1], 0, "forward")
        return self.module(*inputs, **kwargs)

    def generate(self, *inputs: Any, **kwargs: Any) -> Any:
        """The wrapped model's ``generate`` (Hugging Face's), with the token budget checked."""
        if not hasattr(self.module, "generate"):
            raise TypeError(
                f"InferenceEngine.generate: the wrapped {type(self.module).__name__} has no "
                "generate(); call the engine (forward) instead."
            )
        ids = kwargs.get("input_ids", inputs[0] if inputs else None)
        if _is_token_ids(ids) and ids.dim() >= 1:
            self._check_tokens(ids.shape[-1], self._new_tokens(kwargs), "generate")
        with self._shared_sampling_seed(kwargs):
            return self.module.generate(*inputs, **kwargs)

    def _new_tokens(self, kwargs: dict[str, Any]) -> int:
        config = kwargs.get("generation_config") or getattr(self.module, "generation_config", None)
        new = kwargs.get("max_new_tokens", getattr(config, "max_new_tokens", None))
        if new is None:
            max_length = kwargs.get("max_length", getattr(config, "max_length", None))
            return 0 if max_length is None else -int(max_length)  # negative: a total length
        return int(new)

    def _check_tokens(self, prompt: int, new: int, where: str) -> None:
        limit = self._config.max_out_tokens
        total = -new if new < 0 else prompt + new
        if total > limit:
            raise ValueError(
                f"InferenceEngine.{where}: {prompt} prompt tokens + {max(new, 0) or total - prompt} "
                f"new tokens = {total} exceeds max_out_tokens={limit}; raise max_out_tokens in the "
                "init_inference config or shorten the request."
            )
        if prompt + self._config.min_out_tokens > limit:
            raise ValueError(
                f"InferenceEngine.{where}: a {prompt}-token prompt leaves {limit - prompt} of "
                f"max_out_tokens={limit} for output, fewer than min_out_tokens="
                f"{self._config.min_out_tokens}; raise max_out_tokens or shorten the prompt."
            )

    @contextlib.contextmanager
    def _shared_sampling_seed(self, kwargs: dict[str, Any]) -> Iterator[None]:
        config = kwargs.get("generation_config") or getattr(self.module, "generation_config", None)
        sampling = kwargs.get("do_sample", getattr(config, "do_sample", False))
        if not sampling or self.mp_world_size == 1 or self.mp_group is None:
            yield
            return
        seed = torch.randint(0, 2**62, (1,), dtype=torch.int64)  # tensor rank 0's wins
        comm.broadcast(seed, src=comm.get_global_rank(self.mp_group, 0), group=self.mp_group)
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(int(seed))
            yield
