"""Request and response bodies of the OpenAI-compatible API (pydantic v2 models).

Only the fields the server honours are typed strictly. Known OpenAI fields the engine
cannot honour (``suffix``, ``tools``) are accepted at their neutral values and rejected
with a 400 otherwise, as are combinations it does not stream (``logprobs``, ``echo`` or
``best_of > n`` with ``stream``); unknown fields are ignored so that clients sending
newer fields keep working. ``null`` means "the default" for every optional field, as
in the OpenAI API.

Sampling values are checked against safe ranges here, at the API boundary, with a
message naming the field, the allowed range and the value received (the sampler
guards its arithmetic again; see ``fastgen/sampling.py``):

==================== ===================================================
temperature          [0, 2] (below 1e-5 means greedy)
top_p                (0, 1]
top_k                [-1, 2**31 - 1] (0 and -1 switch it off)
repetition_penalty   [0.01, 10] (1 switches it off)
presence_penalty     [-2, 2]; frequency_penalty [-2, 2]
n, best_of           [1, 16], best_of >= n
logprobs             completions: [0, 20]; chat: bool with top_logprobs in [0, 20]
logit_bias           token id (string key) -> [-100, 100]
min_tokens           >= 0
seed                 [-2**63, 2**64 - 1] (what torch.Generator takes)
stop                 up to 4 non-empty strings of at most 1024 characters
==================== ===================================================
"""

from __future__ import annotations

import math
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from shardspeed.inference.fastgen.sampling_params import SEED_MAX, SEED_MIN
from shardspeed.inference.serving.structured_format import StructuredFields

TOP_K_MAX = 2**31 - 1
REPETITION_PENALTY_RANGE = (0.01, 10.0)
MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 1024
MAX_SAMPLES = 16
MAX_LOGPROBS = 20


def _check_range(value: float, low: float, high: float, low_open: bool = False) -> float:
    """``value`` if finite and in [low, high] (``(low, high]`` when ``low_open``)."""
    above_low = value > low if low_open else value >= low
    if not (math.isfinite(value) and above_low and value <= high):
        raise ValueError(f"must be in {'(' if low_open else '['}{low:g}, {high:g}]")
    return value


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        """Drop ``"field": null`` for fields whose default is not None (OpenAI semantics)."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {
            k: v
            for k, v in data.items()
            if not (
                v is None
                and k in fields
                and not fields[k].is_required()
                and fields[k].get_default(call_default_factory=True) is not None
            )
        }


class StreamOptions(_Request):
    include_usage: bool = False


class _SamplingFields(_Request, StructuredFields):
    """Sampling fields shared by both endpoints (``top_k``, ``repetition_penalty``,
    ``ignore_eos`` are extensions, as in vLLM; the structured-output fields are in
    :class:`~.structured_format.StructuredFields`)."""

    model: str | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    min_tokens: int = Field(0, ge=0)
    user: str | None = None

    @field_validator("temperature")
    @classmethod
    def _check_temperature(cls, v: float) -> float:
        return _check_range(v, 0.0, 2.0)

    @field_validator("top_p")
    @classmethod
    def _check_top_p(cls, v: float) -> float:
        return _check_range(v, 0.0, 1.0, low_open=True)

    @field_validator("top_k")
    @classmethod
    def _check_top_k(cls, v: int) -> int:
        if not -1 <= v <= TOP_K_MAX:
            raise ValueError(f"must be in [-1, {TOP_K_MAX}] (0 and -1 switch top-k off)")
        return max(v, 0)

    @field_validator("repetition_penalty")
    @classmethod
    def _check_repetition_penalty(cls, v: float) -> float:
        return _check_range(v, *REPETITION_PENALTY_RANGE)

    @field_validator("seed")
    @classmethod
    def _check_seed(cls, v: int | None) -> int | None:
        if v is not None and not SEED_MIN <= v <= SEED_MAX:
            raise ValueError(f"must be in [{SEED_MIN}, {SEED_MAX}]")
        return v

    @field_validator("n")
    @classmethod
    def _check_n(cls, v: int) -> int:
        if not 1 <= v <= MAX_SAMPLES:
            raise ValueError(f"n={v} is not supported: send 1 <= n <= {MAX_SAMPLES}")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _check_penalty(cls, v: float) -> float:
        return _check_range(v, -2.0, 2.0)

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (v or {}).items():
            if not key.isdigit():
                raise ValueError(f'keys must be token ids as strings (e.g. "50256"), got {key!r}')
            if not (math.isfinite(bias) and -100.0 <= bias <= 100.0):
                raise ValueError(f"logit_bias[{key!r}]={bias} must be in [-100, 100]")
        return v

    def logit_bias_ids(self) -> dict[int, float]:
        return {int(k): float(b) for k, b in (self.logit_bias or {}).items()}

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v: str | list[str] | None) -> list[str]:
        stops = [] if v is None else [v] if isinstance(v, str) else list(v)
        if len(stops) > MAX_STOP_STRINGS or any(not 0 < len(s) <= MAX_STOP_CHARS for s in stops):
            raise ValueError(
                f"stop must be a non-empty string or a list of at most {MAX_STOP_STRINGS} "
                f"non-empty strings of at most {MAX_STOP_CHARS} characters each"
            )
        return stops

    def stop_list(self) -> list[str]:
        return list(self.stop or [])  # type: ignore[arg-type]


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int = Field(16, ge=1)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = Field(None, ge=1, le=MAX_SAMPLES)
    suffix: str | None = None

    @field_validator("suffix")
    @classmethod
    def _check_unsupported(cls, v: Any, info: Any) -> Any:
        if v not in (None, ""):
            raise ValueError(f"{info.field_name}={v!r} is not supported by this server; omit it")
        return v

    @model_validator(mode="after")
    def _check_combinations(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of={self.best_of} must be >= n={self.n}")
        if self.stream and (self.logprobs is not None or self.echo):
            raise ValueError(
                "logprobs and echo are not supported with stream=true on this server; "
                "send stream=false"
            )
        if self.stream and self.best_of is not None and self.best_of > self.n:
            raise ValueError("best_of > n cannot be streamed (as in vLLM); send stream=false")
        return self

    def prompt_list(self) -> list[str | list[int]]:
        """The prompt(s) as a list of strings or token-id lists."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(t, int) for t in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class ContentPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Any] | None = None

    @field_validator("tools")
    @classmethod
    def _check_unsupported(cls, v: Any, info: Any) -> Any:
        if v:
            raise ValueError(f"{info.field_name} is not supported by this server; omit it")
        return v

    @model_validator(mode="after")
    def _check_combinations(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        if self.stream and self.logprobs:
            raise ValueError(
                "logprobs is not supported with stream=true on this server; send stream=false"
            )
        return self


# ---- responses ------------------------------------------------------------------------


def _now() -> int:
    return int(time.time())


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0

    def add(self, prompt_tokens: int, completion_tokens: int) -> None:
        self.prompt_tokens += prompt_tokens
        self.completion_tokens += completion_tokens
        self.total_tokens = self.prompt_tokens + self.completion_tokens


class CompletionLogprobs(BaseModel):
    """Legacy completions ``logprobs``: parallel lists, one entry per token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "shardspeed"
    parent: str | None = None  # a LoRA adapter's base model


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


def dump(model: BaseModel) -> dict[str, Any]:
    """JSON-ready dict of a response model (chunks drop ``usage`` when it is None)."""
    data = model.model_dump()
    if "usage" in data and data["usage"] is None:
        del data["usage"]
    if isinstance(model, ChatCompletionChunk):
        for choice in data["choices"]:
            choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
    return data
