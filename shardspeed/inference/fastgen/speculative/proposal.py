"""What a proposer hands the verifier, and the interface every proposer implements."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from shardspeed.inference.fastgen.request import Request


@dataclass
class Proposal:
    """Tokens proposed for one request (maybe none) and the distributions they came from.

    ``probs`` is ``[len(tokens), V]`` (each row the distribution its token was drawn from,
    for rejection sampling), or None for a point mass (greedy drafts, n-gram lookup).
    """

    tokens: list[int] = field(default_factory=list)
    probs: torch.Tensor | None = None


class Proposer(Protocol):
    """Drafts up to ``num_tokens[i]`` tokens after each request's current tokens."""

    def max_tokens(self, req: Request) -> int:
        """Most tokens this proposer can draft for ``req`` now (position limits)."""
        ...

    def propose(
        self, requests: list[Request], block_tables: list[list[int]], num_tokens: list[int]
    ) -> list[Proposal]:
        """Proposals for each request; ``block_tables[i]`` covers the lookahead slots."""
        ...

    def rollback(self, req: Request, num_valid_tokens: int) -> None:
        """Only ``req``'s first ``num_valid_tokens`` positions hold accepted tokens now."""
        ...

    def forget(self, req: Request) -> None:
        """Drop what the proposer keeps about ``req`` (finished or its step failed)."""
        ...
