"""What the engine hands back per request per step (shared with serving)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace


@dataclass
class RequestMetrics:
    """``time.perf_counter()`` timestamps of one request's life."""

    arrival_time: float
    first_token_time: float | None = None
    finish_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # one per generated token
    first_scheduled_time: float | None = None  # first step that computed any of its tokens

    @property
    def time_to_first_token(self) -> float | None:
        """Seconds from arrival to the first generated token (None before it)."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log probability and the ``top`` alternatives as ``(token_id, logprob)``,
    most likely first (empty unless ``logprobs``/``prompt_logprobs`` > 0)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class RequestOutput:
    """A snapshot of one request after an engine step.

    ``output_token_ids`` holds every token generated so far, ``new_token_ids`` only
    those generated in this step (for streaming). ``text`` is the detokenized output
    ("" without a tokenizer). ``finish_reason`` is ``"stop"``, ``"length"``,
    ``"abort"`` or None while running.

    ``index`` is the sample's position among the ``n`` / ``best_of`` samples of its
    prompt (0 for single-sample requests). ``logprobs`` has one entry per generated
    token when ``SamplingParams.logprobs`` is set; ``prompt_logprobs`` one per prompt
    token (None for the first) when ``prompt_logprobs`` is set;
    ``cumulative_logprob`` sums the generated tokens' log probabilities when they
    are computed.
    """

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    new_token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    metrics: RequestMetrics
    index: int = 0
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    cumulative_logprob: float | None = None


def select_best(outputs: list[RequestOutput], n: int) -> list[RequestOutput]:
    """The ``n`` finished samples of one prompt with the highest cumulative log
    probability (``best_of`` semantics), renumbered ``index`` 0..n-1 in that order."""
    ranked = sorted(outputs, key=lambda o: -(o.cumulative_logprob or 0.0))[:n]
    return [replace(o, index=i) for i, o in enumerate(ranked)]
