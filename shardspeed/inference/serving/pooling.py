"""Pool a batch of hidden states into one vector per sequence (the embeddings endpoint).

``hidden``: ``[B, T, H]``, right-padded; ``mask``: ``[B, T]`` with 1 on real tokens.

* ``mean``: the average over real tokens (sentence-transformers' default);
* ``cls``: the first token (BERT's ``[CLS]``);
* ``last``: the last real token (decoder models: the only position that saw the whole
  input, as in E5-Mistral / GTE-Qwen).
"""

from __future__ import annotations

import torch

POOLING_MODES = ("mean", "cls", "last")


def pool(hidden: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """``[B, H]`` pooled float32 vectors of ``hidden`` (``[B, T, H]``) under ``mask`` (``[B, T]``)."""
    hidden = hidden.float()
    if mode == "cls":
        return hidden[:, 0]  # [B, H]
    if mode == "last":
        last = mask.long().sum(dim=1) - 1  # [B] index of each row's last real token
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]  # [B, H]
    if mode == "mean":
        weights = mask.to(hidden.dtype).unsqueeze(-1)  # [B, T, 1]
        return (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1.0)  # [B, H]
    raise ValueError(f"pooling={mode!r} is not supported; choose one of {POOLING_MODES}.")


def normalize(vectors: torch.Tensor) -> torch.Tensor:
    """Rows scaled to unit L2 norm (OpenAI's embeddings are unit vectors)."""
    return torch.nn.functional.normalize(vectors, p=2.0, dim=-1)
