"""Token masks of structured requests, applied to their rows of a batch's logits.

Rows of requests without a guide are not touched and cost nothing beyond one attribute
check; when a batch has guided rows, their bitmasks (one bit per token id, packed in
int32 words as llguidance writes them) are computed in parallel by llguidance's thread
pool and the disallowed ids of those rows set to ``-inf``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

_SHIFTS = torch.arange(8, dtype=torch.uint8)  # bit i of byte j is token 8 * j + i


def guided_rows(requests: Sequence[Any]) -> list[int]:
    """Indices of the requests that carry a guide."""
    return [i for i, r in enumerate(requests) if r.guide is not None]


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[R, W]`` int32 bitmask -> ``[R, vocab_size]`` bool (ids past the mask: False)."""
    as_bytes = bitmask.view(torch.uint8)  # [R, 4 W], little-endian: token order
    bits = (as_bytes.unsqueeze(-1) >> _SHIFTS) & 1  # [R, 4 W, 8]
    allowed = bits.view(bitmask.shape[0], -1).view(torch.bool)  # [R, 32 W]
    width = allowed.shape[1]
    if width >= vocab_size:
        return allowed[:, :vocab_size]
    pad = torch.zeros(bitmask.shape[0], vocab_size - width, dtype=torch.bool)
    return torch.cat([allowed, pad], dim=1)


def compute_bitmask(guides: Sequence[Any]) -> torch.Tensor:
    """``[len(guides), W]`` int32 bitmask of the next allowed tokens of each guide."""
    factory = guides[0].factory
    words = (factory.ll_tokenizer.vocab_size + 31) // 32
    bitmask = torch.zeros(len(guides), words, dtype=torch.int32)  # [R, W]
    if len(guides) == 1:
        guides[0].matcher.unsafe_compute_mask_ptr(bitmask.data_ptr(), words * 4)
    else:
        pairs = [(g.matcher, k) for k, g in enumerate(guides)]
        factory.executor.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), words * 4, len(guides))
    return bitmask


def apply_guides(logits: torch.Tensor, requests: Sequence[Any]) -> torch.Tensor:
    """Set each guided row's disallowed token ids to ``-inf`` in ``logits`` (``[M, V]``,
    row i for ``requests[i]``; modified in place) and return it. Unguided rows are not
    touched; without guided rows nothing is computed."""
    rows = guided_rows(requests)
    if not rows:
        return logits
    guides = [requests[i].guide for i in rows]
    vocab = logits.shape[-1]
    allowed = allowed_tokens(compute_bitmask(guides), vocab)  # [R, V]
    virtual_eos = guides[0].factory.virtual_eos
    if virtual_eos is not None and virtual_eos < vocab:
        allowed[:, virtual_eos] = False  # a stand-in id the model must never emit
    blocked = ~allowed.to(logits.device)  # [R, V]
    with torch.inference_mode():  # the runner's logits are inference tensors
        for k, row in enumerate(rows):
            logits[row].masked_fill_(blocked[k], float("-inf"))
    return logits
