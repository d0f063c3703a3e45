"""Token masks of structured requests, applied to their rows of a batch's logits.

Rows of requests without a guide are not touched and cost nothing beyond one attribute
check. For the guided rows of a batch: their bitmasks (one bit per token id, packed in
int32 words as llguidance writes them) are taken from the engine's
:class:`~.prefetch.MaskPrefetcher` (computed while the forward ran) or computed here by
llguidance's thread pool. CPU float32 logits are then masked in numpy, single-threaded
and vectorized: one gather expands each mask byte into 8 floats (NaN allowed, ``-inf``
blocked) and ``fmin`` with that bias leaves allowed logits as they are and sets the rest to
``-inf`` (16 rows of 32k ids: ~0.2 ms, where torch's broadcast shifts plus a per-row
``masked_fill_`` took ~1-3 ms, far more with two intra-op threads on a busy machine). Other
logits (bf16, GPU) get one ``numpy.unpackbits`` and ``masked_fill_``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from shardspeed.inference.fastgen.structured.prefetch import PrefetchedMasks


# _BIAS_BY_BYTE[b, i]: NaN when bit i of mask byte b is set (the id is allowed), else -inf.
# ``fmin(logit, bias)`` is then the logit where allowed (fmin returns the non-NaN operand,
# a NaN logit stays NaN) and -inf where blocked, whatever the logit: masked_fill's result.
_BIAS_BY_BYTE = np.where(
    (np.arange(256)[:, None] >> np.arange(8)) & 1 == 1, np.float32(np.nan), np.float32(-np.inf)
).astype(np.float32)  # [256, 8]


def guided_rows(requests: Sequence[Any]) -> list[int]:
    """Indices of the requests that carry a guide."""
    return [i for i, r in enumerate(requests) if r.guide is not None]


def mask_words(guide: Any) -> int:
    """int32 words of one bitmask of ``guide``'s tokenizer."""
    return (guide.factory.ll_tokenizer.vocab_size + 31) // 32


def blocked_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[R, W]`` int32 bitmask -> ``[R, vocab_size]`` bool, True where the id is disallowed
    (ids past the mask: True)."""
    num_rows = bitmask.shape[0]
    inverted = ~bitmask.contiguous().numpy().view(np.uint8)  # [R, 4 W]: bit set = blocked
    bits = np.unpackbits(inverted, axis=1, bitorder="little")  # [R, 32 W] 0/1, token order
    blocked = torch.from_numpy(bits).view(torch.bool)
    width = blocked.shape[1]
    if width >= vocab_size:
        return blocked[:, :vocab_size]
    pad = torch.ones(num_rows, vocab_size - width, dtype=torch.bool)
    return torch.cat([blocked, pad], dim=1)


def mask_bias(bitmask: torch.Tensor, vocab_size: int) -> np.ndarray:
    """``[R, W]`` int32 bitmask -> ``[R, vocab_size]`` float32: NaN where the id is allowed,
    ``-inf`` where it is not (ids past the mask: ``-inf``); see ``_BIAS_BY_BYTE``."""
    num_rows = bitmask.shape[0]
    as_bytes = bitmask.contiguous().numpy().view(np.uint8)  # [R, 4 W]
    bias = np.take(_BIAS_BY_BYTE, as_bytes, axis=0).reshape(num_rows, -1)  # [R, 32 W]
    width = bias.shape[1]
    if width >= vocab_size:
        return bias[:, :vocab_size]
    pad = np.full((num_rows, vocab_size - width), -np.inf, dtype=np.float32)
    return np.concatenate([bias, pad], axis=1)


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[R, W]`` int32 bitmask -> ``[R, vocab_size]`` bool (ids past the mask: False)."""
    return ~blocked_tokens(bitmask, vocab_size)


def fill_bitmask(guides: Sequence[Any], bitmask: torch.Tensor) -> None:
    """Write the next allowed tokens of ``guides[k]`` into row k of ``bitmask`` (``[R, W]``
    int32, contiguous). No wait for computations in flight: the mask prefetcher's worker
    thread calls this; everything else calls :func:`compute_bitmask`."""
    nbytes = bitmask.shape[1] * 4
    if len(guides) == 1:
        guides[0].matcher.unsafe_compute_mask_ptr(bitmask.data_ptr(), nbytes)
        return
    pairs = [(g.matcher, k) for k, g in enumerate(guides)]
    executor = guides[0].factory.executor  # releases the GIL while its pool works
    executor.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), nbytes, len(guides))


def compute_bitmask(guides: Sequence[Any]) -> torch.Tensor:
    """``[len(guides), W]`` int32 bitmask of the next allowed tokens of each guide."""
    for guide in guides:
        guide.settle()  # a prefetch still reading this guide's matcher finishes first
    bitmask = torch.empty(len(guides), mask_words(guides[0]), dtype=torch.int32)  # [R, W]
    fill_bitmask(guides, bitmask)
    return bitmask


def _bitmask_of(guides: list[Any], prefetched: PrefetchedMasks | None) -> torch.Tensor:
    """``[R, W]`` bitmask of ``guides``: precomputed rows where ``prefetched`` has them at
    the guide's current state, the others computed now."""
    if prefetched is None:
        return compute_bitmask(guides)
    found = [prefetched.row_of(g) for g in guides]
    missing = [k for k, row in enumerate(found) if row is None]
    if len(missing) == len(guides):
        return compute_bitmask(guides)
    if not missing:
        if found == list(range(prefetched.bitmask.shape[0])):
            return prefetched.bitmask  # the usual case: the same rows in the same order
        return prefetched.bitmask[torch.tensor(found, dtype=torch.long)]
    bitmask = torch.empty(len(guides), prefetched.bitmask.shape[1], dtype=torch.int32)
    have = [k for k, row in enumerate(found) if row is not None]
    src = torch.tensor([found[k] for k in have], dtype=torch.long)
    bitmask[torch.tensor(have, dtype=torch.long)] = prefetched.bitmask[src]
    bitmask[torch.tensor(missing, dtype=torch.long)] = compute_bitmask([guides[k] for k in missing])
    return bitmask


def apply_guides(
    logits: torch.Tensor,
    requests: Sequence[Any],
    prefetched: PrefetchedMasks | None = None,
) -> torch.Tensor:
    """Set each guided row's disallowed token ids to ``-inf`` in ``logits`` (``[M, V]``,
    row i for ``requests[i]``; modified in place) and return it. Unguided rows are not
    touched; without guided rows nothing is computed.

    ``prefetched``: bitmasks the engine computed during the forward
    (:meth:`~.prefetch.MaskPrefetcher.take`); rows it lacks (samples forked this step, a
    guide advanced since) are computed here, so the result is the same either way.
    """
    rows = guided_rows(requests)
    if not rows:
        return logits
    guides = [requests[i].guide for i in rows]
    vocab = logits.shape[-1]
    bitmask = _bitmask_of(guides, prefetched)  # [R, W]
    virtual_eos = guides[0].factory.virtual_eos  # a stand-in id the model must never emit
    if virtual_eos is not None and virtual_eos >= vocab:
        virtual_eos = None
    all_rows = len(rows) == logits.shape[0]
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and not logits.requires_grad:
        bias = mask_bias(bitmask, vocab)  # [R, V]
        if virtual_eos is not None:
            bias[:, virtual_eos] = -np.inf
        values = logits.numpy()  # [M, V], the same memory
        if all_rows:
            np.fmin(values, bias, out=values)
        else:
            for k, row in enumerate(rows):
                np.fmin(values[row], bias[k], out=values[row])
        return logits
    blocked = blocked_tokens(bitmask, vocab)  # [R, V]
    if virtual_eos is not None:
        blocked[:, virtual_eos] = True
    blocked = blocked.to(logits.device)
    with torch.inference_mode():  # the runner's logits are inference tensors
        if all_rows:
            logits.masked_fill_(blocked, float("-inf"))
        else:
            for k, row in enumerate(rows):
                logits[row].masked_fill_(blocked[k], float("-inf"))
    return logits
