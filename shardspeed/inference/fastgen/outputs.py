"""What the engine hands back per request per step (shared with serving)."""

from __future__ import annotations

from dataclasses import dataclass, field


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


@dataclass
class RequestOutput:
    """A snapshot of one request after an engine step.

    ``output_token_ids`` holds every token generated so far, ``new_token_ids`` only
    those generated in this step (for streaming). ``text`` is the detokenized output
    ("" without a tokenizer). ``finish_reason`` is ``"stop"``, ``"length"``,
    ``"abort"`` or None while running.
    """

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    new_token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    metrics: RequestMetrics
