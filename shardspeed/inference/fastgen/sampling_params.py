"""Per-request sampling parameters (the contract shared by the engine and serving)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from shardspeed.inference.fastgen.structured.params import StructuredOutputParams

# torch.Generator.manual_seed accepts exactly this range (64-bit signed or unsigned).
SEED_MIN = -(2**63)
SEED_MAX = 2**64 - 1


@dataclass
class SamplingParams:
    """How one request picks its next tokens and when it stops.

    ``temperature == 0`` means greedy decoding; ``top_k == 0`` and ``top_p == 1``
    switch those filters off. ``seed`` gives the request its own ``torch.Generator``
    so its samples do not depend on what else is in the batch. Generation stops at
    ``max_new_tokens``, at any id in ``stop_token_ids``, at the tokenizer's EOS
    (unless ``ignore_eos``), or when the detokenized text contains a string from
    ``stop`` (the stop string is trimmed from the returned text).

    OpenAI / vLLM extras: ``n`` samples per prompt (``best_of`` >= n drawn, the
    ``n`` with the highest cumulative log probability returned); the samples share
    the prompt's KV blocks. ``logprobs`` (k >= 0) records each generated token's log
    probability plus its ``k`` most likely alternatives; ``prompt_logprobs`` does the
    same for the prompt tokens (for ``echo``). ``presence_penalty`` /
    ``frequency_penalty`` follow OpenAI's definition over the generated tokens;
    ``logit_bias`` adds a value to given token ids; ``min_tokens`` suppresses EOS,
    ``stop_token_ids`` and stop strings until that many tokens exist. ``truncate``:
    when prompt + ``max_new_tokens`` exceeds the engine's ``max_seq_len``, True stops
    at the context (``finish_reason="length"``), False rejects the request.
    ``structured_output``: a JSON schema / JSON object / regex / grammar / choice the
    output must match (token masks, see :mod:`~shardspeed.inference.fastgen.structured`).
    ``lora_name``: the LoRA adapter to generate with, by the name it was loaded under
    (``engine.lora.load``; needs ``enable_lora``); None generates with the base model.
    """

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1
    best_of: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    logit_bias: dict[int, float] = field(default_factory=dict)
    truncate: bool = True
    structured_output: StructuredOutputParams | None = None
    lora_name: str | None = None

    def __post_init__(self) -> None:
        # Accept the common single-value spellings: stop="\n", stop_token_ids=2.
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.stop_token_ids, int):
            self.stop_token_ids = [self.stop_token_ids]

    @property
    def num_samples(self) -> int:
        """Sequences generated for the prompt (``best_of`` when set, else ``n``)."""
        return self.best_of if self.best_of is not None else self.n

    @property
    def needs_logprobs(self) -> bool:
        """True when each generated token's log probability must be computed."""
        return self.logprobs is not None or self.num_samples > self.n

    @property
    def greedy(self) -> bool:
        """True when the next token is the argmax (temperature 0)."""
        return self.temperature == 0.0

    def validate(self) -> None:
        """Raise ``ValueError`` naming the field, the value and the allowed range."""
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(
                f"SamplingParams.max_new_tokens={self.max_new_tokens!r} is invalid: "
                "it must be an int >= 1; pass max_new_tokens=1 or more."
            )
        if not math.isfinite(self.temperature) or self.temperature < 0.0:
            raise ValueError(
                f"SamplingParams.temperature={self.temperature!r} is invalid: it must be a "
                "finite float >= 0 (0 means greedy); pass e.g. temperature=0.7."
            )
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(
                f"SamplingParams.top_k={self.top_k!r} is invalid: it must be an int >= 0 "
                "(0 disables top-k); pass e.g. top_k=50."
            )
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(
                f"SamplingParams.top_p={self.top_p!r} is invalid: it must be in (0, 1] "
                "(1 disables nucleus sampling); pass e.g. top_p=0.9."
            )
        if not math.isfinite(self.repetition_penalty) or self.repetition_penalty <= 0.0:
            raise ValueError(
                f"SamplingParams.repetition_penalty={self.repetition_penalty!r} is invalid: it "
                "must be a finite float > 0 (1 disables it); pass e.g. repetition_penalty=1.1."
            )
        if self.seed is not None and (
            not isinstance(self.seed, int) or not SEED_MIN <= self.seed <= SEED_MAX
        ):
            raise ValueError(
                f"SamplingParams.seed={self.seed!r} is invalid: it must be None or an int in "
                f"[{SEED_MIN}, {SEED_MAX}] (what torch.Generator.manual_seed takes)."
            )
        bad_ids = [t for t in self.stop_token_ids if not isinstance(t, int) or t < 0]
        if bad_ids:
            raise ValueError(
                f"SamplingParams.stop_token_ids contains invalid ids {bad_ids!r}: every entry "
                "must be an int >= 0."
            )
        bad_stops = [s for s in self.stop if not isinstance(s, str) or s == ""]
        if bad_stops:
            raise ValueError(
                f"SamplingParams.stop contains invalid entries {bad_stops!r}: every stop string "
                "must be a non-empty str."
            )
        self._validate_extras()

    def _validate_extras(self) -> None:
        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        if not is_int(self.n) or self.n < 1:
            raise ValueError(f"SamplingParams.n={self.n!r} is invalid: it must be an int >= 1.")
        if self.best_of is not None and (not is_int(self.best_of) or self.best_of < self.n):
            raise ValueError(
                f"SamplingParams.best_of={self.best_of!r} is invalid: it must be None or an int "
                f">= n={self.n}; pass best_of >= n or leave it None."
            )
        if self.num_samples > 1 and self.greedy:
            raise ValueError(
                f"SamplingParams n={self.n}, best_of={self.best_of} with temperature=0 would give "
                "identical greedy samples; pass temperature > 0 or n=1."
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value < 0):
                raise ValueError(
                    f"SamplingParams.{name}={value!r} is invalid: it must be None or an int >= 0 "
                    "(how many top alternatives to return per token)."
                )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not -2.0 <= value <= 2.0:
                raise ValueError(
                    f"SamplingParams.{name}={value!r} is invalid: it must be a float in "
                    "[-2, 2] (OpenAI's range; 0 disables it)."
                )
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_new_tokens:
            raise ValueError(
                f"SamplingParams.min_tokens={self.min_tokens!r} is invalid: it must be an int in "
                f"[0, max_new_tokens={self.max_new_tokens}]."
            )
        for token, bias in self.logit_bias.items():
            if not is_int(token) or token < 0:
                raise ValueError(
                    f"SamplingParams.logit_bias has key {token!r}: keys must be token ids >= 0."
                )
            if not isinstance(bias, (int, float)) or not -100.0 <= bias <= 100.0:
                raise ValueError(
                    f"SamplingParams.logit_bias[{token}]={bias!r} is invalid: biases must be "
                    "numbers in [-100, 100] (OpenAI's range)."
                )
        if self.structured_output is not None:
            if not isinstance(self.structured_output, StructuredOutputParams):
                raise ValueError(
                    f"SamplingParams.structured_output={self.structured_output!r} must be a "
                    "StructuredOutputParams or None."
                )
            self.structured_output.validate()
        if self.lora_name is not None and not (isinstance(self.lora_name, str) and self.lora_name):
            raise ValueError(
                f"SamplingParams.lora_name={self.lora_name!r} must be a non-empty adapter name "
                "or None (the base model)."
            )
