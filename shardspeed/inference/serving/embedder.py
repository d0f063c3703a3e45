"""Text -> vector with a Hugging Face model and a pooling rule (``/v1/embeddings``).

Encoders (``AutoModel``: BERT, RoBERTa...) and decoder models (``*ForCausalLM``: their
base model's final hidden states) both work. The pooling defaults to what the model
directory says (sentence-transformers' ``1_Pooling/config.json``), else ``last`` for
decoder models and ``cls`` for encoders. Inputs are batched by length, right-padded, and
longer than the model's positions is an error naming the input.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import torch

from shardspeed.inference.serving.pooling import POOLING_MODES, normalize, pool

_ST_POOLING_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_lasttoken": "last",
}


def _directory_pooling(path: Any) -> str | None:
    """The pooling a sentence-transformers directory declares (None when it declares none)."""
    if not isinstance(path, (str, Path)):
        return None
    config = Path(path) / "1_Pooling" / "config.json"
    if not config.is_file():
        return None
    data = json.loads(config.read_text())
    return next((mode for key, mode in _ST_POOLING_KEYS.items() if data.get(key)), None)


def _is_decoder(model: Any) -> bool:
    cfg = model.config
    if getattr(cfg, "is_encoder_decoder", False):
        return False
    archs = getattr(cfg, "architectures", None) or [type(model).__name__]
    return bool(getattr(cfg, "is_decoder", False)) or any("CausalLM" in a for a in archs)


class Embedder:
    """One vector per input from ``model``'s final hidden states.

    Args:
        model: a transformers model (its ``base_model`` runs) or a directory
            (``AutoModel.from_pretrained``).
        tokenizer: an HF tokenizer; None loads ``AutoTokenizer`` from the directory.
        pooling: ``"mean"`` | ``"cls"`` | ``"last"`` | ``"auto"`` (see the module doc).
        normalize: scale each vector to unit length (as OpenAI's embeddings).
        max_batch_tokens: padded tokens per forward.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any = None,
        pooling: str = "auto",
        normalize: bool = True,
        max_batch_tokens: int = 8192,
        device: str | torch.device = "cpu",
    ) -> None:
        from transformers import AutoModel, AutoTokenizer

        declared = _directory_pooling(model)
        if isinstance(model, (str, Path)):
            tokenizer = tokenizer or AutoTokenizer.from_pretrained(str(model))
            model = AutoModel.from_pretrained(str(model))
        if tokenizer is None:
            raise ValueError("Embedder needs a tokenizer; pass tokenizer=... (an HF tokenizer).")
        if pooling == "auto":
            pooling = declared or ("last" if _is_decoder(model) else "cls")
        if pooling not in POOLING_MODES:
            raise ValueError(
                f"Embedder(pooling={pooling!r}) is not supported; choose one of "
                f"{(*POOLING_MODES, 'auto')}."
            )
        if not isinstance(max_batch_tokens, int) or max_batch_tokens < 1:
            raise ValueError(
                f"Embedder(max_batch_tokens={max_batch_tokens!r}) must be an int >= 1."
            )
        self.device = torch.device(device)
        self.model = model.base_model.to(self.device).eval()
        self.tokenizer = tokenizer
        self.pooling = pooling
        self.normalize = normalize
        self.max_batch_tokens = max_batch_tokens
        self.max_tokens = getattr(model.config, "max_position_embeddings", None)
        self.dimensions = int(model.config.hidden_size)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self._lock = threading.Lock()  # one forward at a time (called from worker threads)

    def encode(self, item: str | list[int], index: int = 0) -> list[int]:
        """Token ids of one input (special tokens added to text); ``ValueError`` naming
        ``input[index]`` when empty or too long."""
        ids = list(self.tokenizer.encode(item)) if isinstance(item, str) else [int(t) for t in item]
        if not ids or item == "":  # "" would embed only the special tokens
            raise ValueError(f"input[{index}] is empty; send non-empty text or token ids.")
        if self.max_tokens is not None and len(ids) > self.max_tokens:
            raise ValueError(
                f"input[{index}] has {len(ids)} tokens but this model takes at most "
                f"{self.max_tokens}; shorten or split it."
            )
        vocab = self.model.config.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise ValueError(f"input[{index}] has token ids outside the vocabulary [0, {vocab}).")
        return ids

    def embed_ids(self, batch_ids: list[list[int]]) -> torch.Tensor:
        """``[N, H]`` float32 vectors of token-id sequences (in input order)."""
        order = sorted(range(len(batch_ids)), key=lambda i: len(batch_ids[i]))
        out = torch.empty(len(batch_ids), self.dimensions)
        start = 0
        with self._lock, torch.inference_mode():
            while start < len(order):
                end = start + 1  # grow the batch while its padded size fits
                while end < len(order) and len(batch_ids[order[end]]) * (end + 1 - start) <= (
                    self.max_batch_tokens
                ):
                    end += 1
                rows = order[start:end]
                out[rows] = self._forward([batch_ids[i] for i in rows])
                start = end
        return normalize(out) if self.normalize else out

    def _forward(self, seqs: list[list[int]]) -> torch.Tensor:
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), self.pad_id, dtype=torch.long)  # [B, T]
        mask = torch.zeros(len(seqs), width, dtype=torch.long)  # [B, T]
        for row, seq in enumerate(seqs):
            ids[row, : len(seq)] = torch.tensor(seq)
            mask[row, : len(seq)] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        hidden = self.model(input_ids=ids, attention_mask=mask).last_hidden_state  # [B, T, H]
        return pool(hidden, mask, self.pooling).cpu()  # [B, H]
