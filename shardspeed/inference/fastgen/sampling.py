"""Next-token selection: repetition penalty, temperature, top-k, top-p, seeded draws.

The order matches HF ``generate``: repetition penalty, then temperature, top-k,
top-p. Rows whose requests share the same parameters are processed as one
batch; draws use each request's own ``torch.Generator`` when it has a seed, so
its samples do not depend on what else is in the batch.

Every path is numerically guarded: extreme parameters (``repetition_penalty=1e-300``,
a tiny temperature) or non-finite model logits can push logits to ``inf``/``nan``;
:func:`finite_logits` maps them back into float32's range and a row whose
probabilities still cannot be sampled falls back to its argmax, so a draw never
raises "probability tensor contains inf/nan".
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shardspeed.inference.fastgen.request import Request


def apply_repetition_penalty(
    logits: torch.Tensor, token_ids: Sequence[Sequence[int]], penalty: float
) -> torch.Tensor:
    """Divide positive (multiply negative) logits of already-seen tokens by ``penalty``.

    ``logits``: ``[M, V]`` (modified in place and returned); ``token_ids[i]``: the
    prompt and generated tokens of row ``i``.
    """
    if penalty == 1.0:
        return logits
    for row, ids in enumerate(token_ids):
        if not ids:
            continue
        idx = torch.tensor(sorted(set(ids)), dtype=torch.long, device=logits.device)
        seen = logits[row, idx]
        logits[row, idx] = torch.where(seen < 0, seen * penalty, seen / penalty)
    return logits


def finite_logits(logits: torch.Tensor) -> torch.Tensor:
    """``logits`` with ``nan`` -> ``-inf`` and ``+-inf`` overflow clamped to the dtype's range.

    A filtered-out token stays ``-inf``; a logit that overflowed to ``+inf`` becomes the
    largest finite value (it stays the most likely token, without breaking softmax).
    """
    big = torch.finfo(logits.dtype).max
    return torch.nan_to_num(logits, nan=float("-inf"), posinf=big, neginf=float("-inf"))


def safe_probs(logits: torch.Tensor) -> torch.Tensor:
    """Softmax of ``[M, V]`` logits; a row that is not a distribution becomes one-hot argmax."""
    probs = logits.softmax(dim=-1)  # [M, V]
    bad = ~torch.isfinite(probs).all(dim=-1) | (probs.sum(dim=-1) <= 0)  # [M]
    if bad.any():
        one_hot = torch.zeros_like(probs[bad])
        one_hot.scatter_(-1, finite_logits(logits[bad]).argmax(dim=-1, keepdim=True), 1.0)
        probs[bad] = one_hot
    return probs


def apply_top_k(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Keep the ``top_k`` largest logits per row (ties at the k-th value kept); 0 = off."""
    if top_k <= 0 or top_k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]  # [M, 1]
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability mass reaches ``top_p``."""
    if top_p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # [M, V]
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # mass of strictly more likely tokens
    drop_sorted = mass_before >= top_p
    drop_sorted[..., 0] = False  # always keep the most likely token
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def _group_key(req: Request) -> tuple:
    p = req.params
    return (p.temperature, p.top_k, p.top_p, p.repetition_penalty)


def sample_next_tokens(logits: torch.Tensor, requests: Sequence[Request]) -> list[int]:
    """One next token per row of ``logits`` (``[M, V]``, row ``i`` for ``requests[i]``)."""
    logits = logits.float()
    groups: dict[tuple, list[int]] = {}
    for row, req in enumerate(requests):
        groups.setdefault(_group_key(req), []).append(row)
    result = [0] * len(requests)
    for (temperature, top_k, top_p, penalty), rows in groups.items():
        group = logits[torch.tensor(rows, device=logits.device)]  # [G, V] (a copy)
        if penalty != 1.0:
            apply_repetition_penalty(group, [requests[r].all_token_ids for r in rows], penalty)
        if temperature == 0.0:
            chosen = finite_logits(group).argmax(dim=-1).tolist()
        else:
            group = apply_top_p(apply_top_k(finite_logits(group / temperature), top_k), top_p)
            chosen = _draw(safe_probs(group), [requests[r] for r in rows])
        for row, token in zip(rows, chosen):
            result[row] = int(token)
    return result


def _draw(probs: torch.Tensor, requests: Sequence[Request]) -> list[int]:
    """Multinomial draws; seeded requests use their own generator (on CPU)."""
    out = [0] * len(requests)
    unseeded = [i for i, r in enumerate(requests) if r.generator is None]
    if unseeded:
        idx = torch.tensor(unseeded, device=probs.device)
        draws = torch.multinomial(probs[idx], 1).squeeze(-1).tolist()
        for i, tok in zip(unseeded, draws):
            out[i] = tok
    for i, req in enumerate(requests):
        if req.generator is not None:
            out[i] = int(torch.multinomial(probs[i].cpu(), 1, generator=req.generator))
    return out
