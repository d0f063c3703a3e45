"""Per-request sampling parameters (the contract shared by the engine and serving)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

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

    def __post_init__(self) -> None:
        # Accept the common single-value spellings: stop="\n", stop_token_ids=2.
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.stop_token_ids, int):
            self.stop_token_ids = [self.stop_token_ids]

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
