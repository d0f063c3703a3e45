"""Verification of proposed tokens against the target's logits.

Row ``j`` of a request's verify logits (``[k + 1, V]``) is the target's distribution of
the token after ``x, d_1 .. d_j`` (``x`` the last sampled token, ``d`` the proposals).

* Greedy: ``d_j`` is kept while it equals the target's argmax of row ``j - 1``; the first
  mismatching row (or row ``k`` when all are kept) gives one more token, its argmax. The
  tokens are those of the target decoding alone.
* Sampling: speculative rejection sampling (Leviathan et al. 2023; Chen et al. 2023).
  ``d_j`` drawn from the proposer's ``q_j`` is kept with probability
  ``min(1, p_j(d_j) / q_j(d_j))``; at the first rejection a token is drawn from
  ``norm(max(0, p_j - q_j))``; when all are kept a bonus token is drawn from ``p_k``.
  Every emitted token is then distributed exactly as the target's sampling (``p`` after
  temperature, top-k and top-p, as :func:`~..sampling.sample_next_tokens` draws it). A
  proposer without a distribution (n-gram lookup) is a point mass: ``q_j(d_j) = 1``.
"""

from __future__ import annotations

import torch

from shardspeed.inference.fastgen.sampling import (
    apply_top_k,
    apply_top_p,
    finite_logits,
    safe_probs,
)
from shardspeed.inference.fastgen.sampling_params import SamplingParams


def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """``[M, V]`` probabilities the engine samples from for ``params`` (temperature > 0):
    temperature, top-k, top-p, then a guarded softmax."""
    scaled = finite_logits(logits.float() / params.temperature)
    return safe_probs(apply_top_p(apply_top_k(scaled, params.top_k), params.top_p))


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from the distribution ``probs`` (``[V]``); seeded draws on the CPU."""
    if generator is not None:
        return int(torch.multinomial(probs.cpu(), 1, generator=generator))
    return int(torch.multinomial(probs, 1))


def verify_greedy(target_logits: torch.Tensor, draft_tokens: list[int]) -> list[int]:
    """Emitted tokens: the proposals the target's argmax agrees with, then its own next."""
    best = finite_logits(target_logits).argmax(dim=-1).tolist()  # [k + 1]
    emitted: list[int] = []
    for j, token in enumerate(draft_tokens):
        if best[j] != token:
            break
        emitted.append(token)
    emitted.append(int(best[len(emitted)]))
    return emitted


def verify_sampled(
    target_probs: torch.Tensor,
    draft_tokens: list[int],
    draft_probs: torch.Tensor | None,
    generator: torch.Generator | None,
) -> list[int]:
    """Emitted tokens by rejection sampling.

    ``target_probs``: ``[k + 1, V]``; ``draft_probs``: ``[k, V]`` the distributions the
    proposals were drawn from, or None for point-mass proposals.
    """
    k = len(draft_tokens)
    idx = torch.tensor(draft_tokens, dtype=torch.long, device=target_probs.device)  # [k]
    p_d = target_probs[:k].gather(1, idx[:, None]).squeeze(1).cpu()  # [k]
    if draft_probs is None:
        q_d = torch.ones(k)
    else:
        q_d = draft_probs.gather(1, idx[:, None].to(draft_probs.device)).squeeze(1).cpu()
    u = torch.rand(k, generator=generator) if generator is not None else torch.rand(k)
    keep = (u * q_d < p_d).tolist()  # u < p / q, without dividing by a tiny q
    emitted: list[int] = []
    for j, token in enumerate(draft_tokens):
        if not keep[j]:
            p = target_probs[j]
            if draft_probs is None:
                residual = p.clone()
                residual[token] = 0.0
            else:
                residual = (p - draft_probs[j].to(p.device)).clamp_min(0.0)
            total = float(residual.sum())
            emitted.append(draw(residual / total if total > 0 else p, generator))
            return emitted
        emitted.append(token)
    emitted.append(draw(target_probs[k], generator))
    return emitted
