"""Next-token selection: logits processors, temperature, top-k, top-p, seeded draws.

Order: the per-request processors of :func:`process_logits` (HF's repetition
penalty, OpenAI's presence / frequency penalties, ``logit_bias``, the ``min_tokens``
EOS/stop mask), then temperature, top-k, top-p as in HF ``generate``. Log
probabilities (``fastgen/logprobs.py``) are the log-softmax of the processed logits,
before temperature and filtering. Rows whose requests share temperature/top-k/top-p
are drawn as one batch; draws use each request's own ``torch.Generator`` when it has
a seed, so its samples do not depend on what else is in the batch.

Every path is numerically guarded: extreme parameters (``repetition_penalty=1e-300``,
a tiny temperature) or non-finite model logits can push logits to ``inf``/``nan``;
:func:`finite_logits` maps them back into float32's range and a row whose
probabilities still cannot be sampled falls back to its argmax, so a draw never
raises "probability tensor contains inf/nan".
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shardspeed.inference.fastgen import cpu_fused
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


def apply_presence_frequency_penalties(
    logits: torch.Tensor, output_ids: Sequence[int], presence: float, frequency: float
) -> torch.Tensor:
    """OpenAI's penalties on one row ``[V]`` (in place): ``logit[j] -= c[j] * frequency
    + (c[j] > 0) * presence`` where ``c[j]`` counts token ``j`` in the generated output."""
    if not output_ids or (presence == 0.0 and frequency == 0.0):
        return logits
    ids = torch.tensor(output_ids, dtype=torch.long, device=logits.device)
    counts = torch.bincount(ids, minlength=logits.shape[-1]).to(logits.dtype)  # [V]
    logits -= counts * frequency + (counts > 0).to(logits.dtype) * presence
    return logits


def process_logits(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
    """Float32 copy of ``logits`` (``[M, V]``) after each row's request-level processors.

    In order: repetition penalty (HF's, over prompt + output), presence / frequency
    penalties (OpenAI's, over the output), ``logit_bias``, and ``-inf`` on EOS / stop
    token ids while the output is shorter than ``min_tokens``.
    """
    rows = [i for i, r in enumerate(requests) if _has_processors(r)]
    if not rows:
        return logits.float()  # nothing to change: no copy
    out = logits.float().clone()
    for row in rows:
        req = requests[row]
        p = req.params
        if p.repetition_penalty != 1.0:
            apply_repetition_penalty(out[row : row + 1], [req.all_token_ids], p.repetition_penalty)
        apply_presence_frequency_penalties(
            out[row], req.output_token_ids, p.presence_penalty, p.frequency_penalty
        )
        if p.logit_bias:
            idx = torch.tensor(list(p.logit_bias), dtype=torch.long, device=out.device)
            bias = torch.tensor(list(p.logit_bias.values()), dtype=out.dtype, device=out.device)
            out[row].index_add_(0, idx, bias)
        if len(req.output_token_ids) < p.min_tokens and req.min_tokens_suppressed_ids:
            out[row, list(req.min_tokens_suppressed_ids)] = float("-inf")
    return out


def _has_processors(req: Request) -> bool:
    p = req.params
    return (
        p.repetition_penalty != 1.0
        or p.presence_penalty != 0.0
        or p.frequency_penalty != 0.0
        or bool(p.logit_bias)
        or p.min_tokens > 0
    )


def argmax_only(req: Request) -> bool:
    """Whether ``req``'s next token is the argmax of its raw logits and nothing else is read
    from them: greedy, no logits processors, no logprobs (``best_of`` ranks by them) and no
    grammar. Such rows may stay in the model's dtype: upcasting bf16 / fp16 to fp32 is exact
    and keeps the order, so the argmax (ties and ``nan`` included) is the same."""
    p = req.params
    return p.greedy and not p.needs_logprobs and not _has_processors(req) and req.guide is None


def finite_logits(logits: torch.Tensor) -> torch.Tensor:
    """``logits`` with ``nan`` -> ``-inf`` and ``+-inf`` overflow clamped to the dtype's range.

    A filtered-out token stays ``-inf``; a logit that overflowed to ``+inf`` becomes the
    largest finite value (it stays the most likely token, without breaking softmax).
    """
    big = torch.finfo(logits.dtype).max
    return torch.nan_to_num(logits, nan=float("-inf"), posinf=big, neginf=float("-inf"))


_ARGMAX_CHUNK = 256


def row_argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1)`` of ``[M, V]`` rows, the same indices (first maximum; ``nan``
    counts as the maximum, as in ``argmax``), several times faster on CPU for a large ``V``:
    the fused CPU kernel's :func:`~.cpu_fused.row_argmax` where it is active; else ``amax``
    (vectorised) over chunks of 256, ``argmax`` over the chunk maxima, then within the
    chosen chunk; the ``V % 256`` tail is compared last (it wins only when strictly greater,
    or ``nan`` where the rest has none)."""
    rows, vocab = logits.shape
    n = vocab // _ARGMAX_CHUNK
    if n < 2 or logits.device.type != "cpu":
        return logits.argmax(dim=-1)
    if logits.stride(-1) == 1 and cpu_fused.active(logits):
        return cpu_fused.row_argmax(logits)
    main = logits[:, : n * _ARGMAX_CHUNK].view(rows, n, _ARGMAX_CHUNK)
    chunk_max = main.amax(dim=-1)  # [M, n]
    chunk = chunk_max.argmax(dim=-1)  # [M]
    picked = chunk * _ARGMAX_CHUNK + main[torch.arange(rows), chunk].argmax(dim=-1)
    if n * _ARGMAX_CHUNK == vocab:
        return picked
    tail = logits[:, n * _ARGMAX_CHUNK :]
    tail_arg = tail.argmax(dim=-1)  # [M]
    tail_max = tail.gather(-1, tail_arg.unsqueeze(-1)).squeeze(-1)
    best = chunk_max.gather(-1, chunk.unsqueeze(-1)).squeeze(-1)
    tail_wins = (tail_max > best) | (tail_max.isnan() & ~best.isnan())
    return torch.where(tail_wins, n * _ARGMAX_CHUNK + tail_arg, picked)


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """``finite_logits(logits).argmax(-1)`` without the full copy: ``argmax`` already picks
    the first ``+inf`` (as the clamp to the largest finite value would) and leaves ``-inf``
    alone; only a row whose maximum is ``nan`` needs :func:`finite_logits`."""
    chosen = row_argmax(logits)  # [M]
    if torch.isnan(logits.gather(-1, chosen.unsqueeze(-1))).any():
        chosen = finite_logits(logits.float()).argmax(dim=-1)  # fp32's clamp, whatever dtype
    return chosen.tolist()


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
    return (p.temperature, p.top_k, p.top_p)


def sample_next_tokens(logits: torch.Tensor, requests: Sequence[Request]) -> list[int]:
    """One next token per row of ``logits`` (``[M, V]``, row ``i`` for ``requests[i]``);
    ``logits`` may be in the model's dtype when every request is :func:`argmax_only`."""
    if all(argmax_only(r) for r in requests):
        return greedy_tokens(logits)
    logits = process_logits(logits, requests)
    groups: dict[tuple, list[int]] = {}
    for row, req in enumerate(requests):
        groups.setdefault(_group_key(req), []).append(row)
    result = [0] * len(requests)
    for (temperature, top_k, top_p), rows in groups.items():
        if len(rows) == len(requests):  # one group: every row, in order (no copy)
            group = logits
        else:
            group = logits[torch.tensor(rows, device=logits.device)]  # [G, V] (a copy)
        if temperature == 0.0:
            chosen = greedy_tokens(group)
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
