"""Log probabilities of sampled and prompt tokens (OpenAI ``logprobs`` / ``echo``).

A generated token's log probability is the log-softmax of its row's *processed*
logits (:func:`~.sampling.process_logits`: penalties, ``logit_bias``, the
``min_tokens`` mask), before temperature and top-k / top-p, so that it does not
depend on how the token was drawn. Prompt tokens use the raw model logits of the
position before them (no processors: nothing was sampled there).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shardspeed.inference.fastgen.outputs import TokenLogprob
from shardspeed.inference.fastgen.request import Request
from shardspeed.inference.fastgen.sampling import process_logits


def logprobs_of(log_probs: torch.Tensor, token_ids: Sequence[int], k: int) -> list[TokenLogprob]:
    """``TokenLogprob`` of ``token_ids[i]`` in row ``i`` of ``log_probs`` (``[M, V]``)
    with the ``k`` most likely alternatives of that row."""
    idx = torch.tensor(list(token_ids), dtype=torch.long, device=log_probs.device)
    chosen = log_probs.gather(1, idx[:, None]).squeeze(1).tolist()  # [M]
    tops: list[tuple[tuple[int, float], ...]] = [()] * len(chosen)
    if k > 0:
        values, ids = log_probs.topk(min(k, log_probs.shape[-1]), dim=-1)  # [M, k]
        tops = [tuple(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    return [TokenLogprob(int(t), float(lp), top) for t, lp, top in zip(token_ids, chosen, tops)]


def sampled_logprobs(
    logits: torch.Tensor, requests: Sequence[Request], tokens: Sequence[int]
) -> list[TokenLogprob]:
    """Log probabilities of the sampled ``tokens`` (row ``i`` of ``logits`` is ``requests[i]``'s)."""
    log_probs = process_logits(logits, requests).log_softmax(dim=-1)  # [M, V]
    k = max((r.params.logprobs or 0) for r in requests)
    out = logprobs_of(log_probs, tokens, k)
    return [
        TokenLogprob(o.token_id, o.logprob, o.top[: r.params.logprobs or 0])
        for o, r in zip(out, requests)
    ]


def record_prompt_logprobs(req: Request, rows: torch.Tensor, start_position: int) -> None:
    """Extend ``req.prompt_logprobs`` from the raw logits ``rows`` (``[R, V]``) of
    positions ``start_position .. start_position + R - 1``; row ``j`` predicts the
    token at position ``start_position + j + 1``."""
    assert req.prompt_logprobs is not None
    num_prompt = len(req.prompt_token_ids)
    first = len(req.prompt_logprobs)  # next prompt position that lacks its logprob
    lo = first - 1 - start_position  # the row predicting position ``first``
    hi = min(rows.shape[0], num_prompt - 1 - start_position)
    if lo < 0 or lo >= hi:
        return  # recomputed rows (after preemption) that are already recorded
    targets = req.prompt_token_ids[first : first + hi - lo]
    log_probs = rows[lo:hi].float().log_softmax(dim=-1)  # [hi - lo, V]
    req.prompt_logprobs.extend(logprobs_of(log_probs, targets, req.params.prompt_logprobs or 0))
