"""One generation request: its tokens, progress through the KV cache and status.

The one number that drives scheduling is ``num_computed_tokens``: how many of the
request's tokens (prompt + generated) already have K/V in the cache. A request
whose computed count is behind its token count needs work; when a step computes
its last token, the logits of that token pick the next one.
"""

from __future__ import annotations

import enum
import time
from typing import Any

import torch

from shardspeed.inference.fastgen.block_pool import hash_block_tokens
from shardspeed.inference.fastgen.detokenizer import DetokenizerState
from shardspeed.inference.fastgen.outputs import RequestMetrics, RequestOutput, TokenLogprob
from shardspeed.inference.fastgen.sampling_params import SEED_MIN, SamplingParams


def sample_request_ids(request_id: str, num_samples: int) -> list[str]:
    """Ids of the samples of one request: itself alone, or ``"<id>#<i>"`` for each of
    ``num_samples`` > 1 samples."""
    if num_samples == 1:
        return [request_id]
    return [f"{request_id}#{i}" for i in range(num_samples)]


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
        index: int = 0,
    ):
        self.request_id = request_id
        self.index = index  # sample index among the n / best_of samples of one prompt
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
        # Length-dependent RoPE (dynamic, longrope): the token at position p is rotated for
        # sequence length max(rope_base_len, p + 1), as HF's generate computes it: the prompt
        # for the prompt's length, each generated token for its own. The scheduler raises it
        # when it recomputes the whole sequence (longrope crossing its original length).
        self.rope_base_len = len(self.prompt_token_ids)
        self.hash_root = b"root"  # root of the block-hash chain (keyed by the RoPE variant)
        self.finish_reason: str | None = None
        self.text = ""
        self.detokenizer = DetokenizerState()  # the window req.text was last extended from
        self.stop_checked_chars = 0  # text length already searched for stop strings
        self.num_emitted_tokens = 0  # tokens already handed out in a RequestOutput
        self.metrics = RequestMetrics(
            arrival_time=time.perf_counter() if arrival_time is None else arrival_time
        )
        self.fork_ids: list[str] = []  # sample ids to fork from this request after prefill
        self.min_tokens_suppressed_ids: list[int] = []  # EOS / stop ids masked below min_tokens
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        self.prompt_logprobs: list[TokenLogprob | None] | None = None
        if params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]  # the first prompt token has no logprob
        self.cumulative_logprob = 0.0
        self.guide: Any = None  # structured output: a structured.Guide (the engine sets it)
        self.lora: Any = None  # the lora.LoRAAdapter it generates with (None: base model)
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator(device="cpu")
            # Sample i of a seeded request draws from seed + i (wrapped into the valid range).
            self.generator.manual_seed((params.seed + index - SEED_MIN) % 2**64 + SEED_MIN)

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
            parent = self.block_hashes[-1] if i else self.hash_root + self.lora_cache_key
            tokens = self.token_slice(i * block_size, (i + 1) * block_size)
            self.block_hashes.append(hash_block_tokens(parent, tokens))
        return self.block_hashes[:num_full]

    @property
    def lora_cache_key(self) -> bytes:
        """Separates prefix-cache blocks of different adapters (their K/V differ)."""
        return b"" if self.lora is None else self.lora.cache_key

    def new_sample(self, sample_id: str) -> Request:
        """Another sample of this request's prompt (``sample_id`` ends in ``#<index>``),
        waiting, with the prompt state this request has recorded so far."""
        index = int(sample_id.rsplit("#", 1)[1])
        sample = Request(
            sample_id, self.prompt_token_ids, self.params, self.metrics.arrival_time, index
        )
        sample.min_tokens_suppressed_ids = self.min_tokens_suppressed_ids
        sample.rope_base_len = self.rope_base_len
        sample.hash_root = self.hash_root
        sample.guide = self.guide.fresh() if self.guide is not None else None
        sample.lora = self.lora
        sample.metrics.first_scheduled_time = self.metrics.first_scheduled_time
        if self.prompt_logprobs is not None:
            sample.prompt_logprobs = list(self.prompt_logprobs)
        return sample

    # ----------------------------------------------------------------- outputs
    @property
    def wants_prompt_logprobs(self) -> bool:
        """True while some prompt tokens still lack their log probability."""
        pl = self.prompt_logprobs
        return pl is not None and len(pl) < len(self.prompt_token_ids)

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
            index=self.index,
            logprobs=None if self.logprobs is None else list(self.logprobs),
            prompt_logprobs=None if self.prompt_logprobs is None else list(self.prompt_logprobs),
            cumulative_logprob=self.cumulative_logprob if self.params.needs_logprobs else None,
        )

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={len(self.block_table)})"
        )
