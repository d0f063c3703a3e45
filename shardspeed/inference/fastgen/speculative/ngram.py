"""Prompt-lookup (n-gram) proposals: no draft model.

For the longest ``n`` in ``[prompt_lookup_min, prompt_lookup_max]`` whose trailing
n-gram of the request's tokens (prompt + output) occurred before, the tokens that
followed its most recent earlier occurrence with ``k`` tokens after it (else the
occurrence with the most after it) are proposed (vLLM's ``"ngram"`` method).
Cheap, and useful where outputs repeat their input: summaries, code edits, extraction.
"""

from __future__ import annotations

import numpy as np

from shardspeed.inference.fastgen.request import Request
from shardspeed.inference.fastgen.speculative.proposal import Proposal


def lookup_ngram(tokens: list[int], num_tokens: int, min_n: int, max_n: int) -> list[int]:
    """Up to ``num_tokens`` tokens that followed an earlier occurrence of the longest
    trailing n-gram (``min_n <= n <= max_n``) of ``tokens``; [] if none occurs."""
    length = len(tokens)
    if num_tokens <= 0 or length < min_n + 1:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = arr[length - n :]
        windows = np.lib.stride_tricks.sliding_window_view(arr[: length - 1], n)  # [L - n, n]
        hits = np.flatnonzero((windows == suffix).all(axis=1))  # starts of earlier matches
        if hits.size:
            # the latest match followed by num_tokens tokens, else the one followed by the
            # most (in a loop shorter than num_tokens, the latest match is followed by one
            # period only)
            full = hits[hits + n + num_tokens <= length]
            start = int(full[-1] if full.size else hits[0]) + n
            return arr[start : start + num_tokens].tolist()
    return []


class NgramProposer:
    """Proposes by prompt lookup; holds no state and no KV."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n = min_n
        self.max_n = max_n

    def max_tokens(self, req: Request) -> int:
        return 1 << 30

    def propose(
        self, requests: list[Request], block_tables: list[list[int]], num_tokens: list[int]
    ) -> list[Proposal]:
        return [
            Proposal(lookup_ngram(req.all_token_ids, k, self.min_n, self.max_n))
            for req, k in zip(requests, num_tokens)
        ]

    def rollback(self, req: Request, num_valid_tokens: int) -> None:
        pass

    def forget(self, req: Request) -> None:
        pass
