"""One generation request: its tokens, progress through the KV cache and status.

The one number that drives scheduling is ``num_computed_tokens``: how many of the
request's tokens (prompt + generated) already have K/V in the cache. A request
whose computed count is behind its token count needs work; when a step computes
its last token, the logits of that token pick the next one.
"""

from __future__ import annotations

import enum
import time

import torch

from shardspeed.inference.fastgen.block_pool import hash_block_tokens
from shardspeed.inference.fastgen.outputs import RequestMetrics, RequestOutput
from shardspeed.inference.fastgen.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    """Scheduler-side state of one request."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
    ):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []  # chained hashes of this request's full blocks
        self.num_registered_blocks = 0  # full blocks already offered to the prefix cache
        self.num_preemptions = 0
        self.num_cached_prompt_tokens = 0  # tokens taken from the prefix cache at admission
        self.finish_reason: str | None = None
        self.text = ""
        self.stop_checked_chars = 0  # text length already searched for stop strings
        self.num_emitted_tokens = 0  # tokens already handed out in a RequestOutput
        self.metrics = RequestMetrics(
            arrival_time=time.perf_counter() if arrival_time is None else arrival_time
        )
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator(device="cpu")
            self.generator.manual_seed(params.seed)

    # ------------------------------------------------------------------ tokens
    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_remaining_tokens(self) -> int:
        """Tokens not yet in the KV cache."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_decoding(self) -> bool:
        """True when exactly the last generated token is uncomputed (a 1-token step)."""
        return bool(self.output_token_ids) and self.num_remaining_tokens == 1

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens ``[start, end)`` of prompt + output without building the full list."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    def compute_block_hashes(self, block_size: int, upto_tokens: int) -> list[bytes]:
        """Extend and return chained hashes of full blocks within the first ``upto_tokens``."""
        num_full = min(upto_tokens, self.num_tokens) // block_size
        while len(self.block_hashes) < num_full:
            i = len(self.block_hashes)
            parent = self.block_hashes[-1] if i else None
            tokens = self.token_slice(i * block_size, (i + 1) * block_size)
            self.block_hashes.append(hash_block_tokens(parent, tokens))
        return self.block_hashes[:num_full]

    # ----------------------------------------------------------------- outputs
    def append_token(self, token_id: int, now: float) -> None:
        self.output_token_ids.append(token_id)
        if self.metrics.first_token_time is None:
            self.metrics.first_token_time = now
        self.metrics.token_times.append(now)

    def finish(self, reason: str, now: float | None = None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.metrics.finish_time = now if now is not None else time.perf_counter()

    def make_output(self) -> RequestOutput:
        """Snapshot for the caller; ``new_token_ids`` are those not emitted before."""
        new = self.output_token_ids[self.num_emitted_tokens :]
        self.num_emitted_tokens = len(self.output_token_ids)
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=list(self.prompt_token_ids),
            output_token_ids=list(self.output_token_ids),
            new_token_ids=list(new),
            text=self.text,
            finished=self.is_finished,
            finish_reason=self.finish_reason,
            metrics=self.metrics,
        )

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={len(self.block_table)})"
        )
