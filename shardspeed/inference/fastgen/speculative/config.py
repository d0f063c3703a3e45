"""``EngineConfig.speculative_config``: which proposer drafts tokens, and how many.

The keys follow vLLM's ``--speculative-config`` JSON::

    {"method": "draft_model", "model": "path/to/small-model", "num_speculative_tokens": 4,
     "quantization": "int4"}
    {"method": "ngram", "num_speculative_tokens": 4,
     "prompt_lookup_max": 4, "prompt_lookup_min": 1}

``method`` may be left out when ``model`` is given (then ``"draft_model"``). Unknown
keys are refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

SPECULATIVE_METHODS = ("draft_model", "ngram")


def _positive_int(name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(
            f"speculative_config.{name}={value!r} must be an int >= 1 (e.g. {name}=4)."
        )
    return value


@dataclass
class SpeculativeConfig:
    """Speculative decoding of an engine's decode steps.

    Attributes:
        method: ``"draft_model"`` (a smaller model with the same tokenizer proposes
            tokens) or ``"ngram"`` (prompt lookup: the tokens that followed the last
            occurrence of the sequence's trailing n-gram are proposed).
        num_speculative_tokens: tokens proposed per decode step (k); the target
            verifies all k+1 positions in one forward.
        model: the draft (``"draft_model"`` only): an HF directory, a transformers
            model, a shardspeed GPT or a ragged model, of the target's vocabulary.
        draft_dtype: the draft's dtype; None => the target's compute dtype.
        quantization: weight-only quantization of the draft's linear layers (``"draft_model"``
            only), as ``EngineConfig.quantization`` takes it (``"int8"``, ``"int4"``,
            ``"int4-g64-asym"``, a dict or a ``WeightQuantConfig``); None keeps the draft
            in ``draft_dtype``. A draft only proposes (the target checks every token), so
            a quantized draft changes the acceptance rate, never the output; it makes
            each draft step read a half or a quarter of the bytes.
        prompt_lookup_max: longest n-gram matched (``"ngram"`` only).
        prompt_lookup_min: shortest n-gram matched (``"ngram"`` only).
    """

    method: str = "draft_model"
    num_speculative_tokens: int = 4
    model: Any = None
    draft_dtype: Any = None
    quantization: Any = None
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1

    @classmethod
    def parse(cls, value: Any) -> SpeculativeConfig | None:
        """``None``, a :class:`SpeculativeConfig`, or a dict of its fields (validated)."""
        if value is None or isinstance(value, SpeculativeConfig):
            if value is not None:
                value.validate()
            return value
        if not isinstance(value, dict):
            raise ValueError(
                f"EngineConfig.speculative_config={value!r} must be None, a dict such as "
                '{"method": "ngram", "num_speculative_tokens": 4} or a SpeculativeConfig.'
            )
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(
                f"speculative_config has unknown key(s) {unknown}; known keys: {sorted(known)}."
            )
        kwargs = dict(value)
        if "method" not in kwargs:
            if kwargs.get("model") is None:
                raise ValueError(
                    "speculative_config needs a 'method' (one of "
                    f"{SPECULATIVE_METHODS}) or a draft 'model'."
                )
            kwargs["method"] = "draft_model"
        if "num_speculative_tokens" not in kwargs:
            raise ValueError(
                "speculative_config needs 'num_speculative_tokens' (tokens proposed per "
                "step, e.g. 4)."
            )
        config = cls(**kwargs)
        config.validate()
        return config

    def validate(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative_config.method={self.method!r} is not supported; choose one of "
                f"{SPECULATIVE_METHODS}."
            )
        _positive_int("num_speculative_tokens", self.num_speculative_tokens)
        if self.method == "draft_model" and self.model is None:
            raise ValueError(
                "speculative_config.method='draft_model' needs 'model' (the draft: an HF "
                "directory or model with the target's tokenizer); or use method='ngram'."
            )
        if self.method == "draft_model" and self.quantization is not None:
            from shardspeed.inference.quantization import WeightQuantConfig

            try:
                self.quantization = WeightQuantConfig.parse(self.quantization)
            except (TypeError, ValueError) as err:
                raise ValueError(f"speculative_config.quantization: {err}") from err
        if self.method == "ngram":
            for name in ("model", "quantization"):
                if getattr(self, name) is not None:
                    raise ValueError(
                        f"speculative_config.{name}={getattr(self, name)!r} is set but "
                        f"method='ngram' uses no draft model; drop '{name}' or use "
                        "method='draft_model'."
                    )
            lo = _positive_int("prompt_lookup_min", self.prompt_lookup_min)
            hi = _positive_int("prompt_lookup_max", self.prompt_lookup_max)
            if lo > hi:
                raise ValueError(
                    f"speculative_config.prompt_lookup_min={lo} is above prompt_lookup_max={hi}; "
                    "use prompt_lookup_min <= prompt_lookup_max."
                )

    def check_engine(self, config: Any) -> None:
        """Refuse engine options the speculative path does not run with (yet)."""
        for name, ok in (
            ("tensor_parallel", 1),
            ("pipeline_parallel", 1),
            ("expert_parallel", 1),
        ):
            value = getattr(config, name)
            if value != ok:
                raise ValueError(
                    f"EngineConfig.speculative_config cannot be combined with {name}={value} yet "
                    f"(the verify forward runs in one process); use {name}={ok} or drop "
                    "speculative_config."
                )
        for name in ("offload", "enable_lora"):
            if getattr(config, name, None):  # enable_lora: adapters are untested with drafts
                raise ValueError(
                    f"EngineConfig.speculative_config cannot be combined with {name}="
                    f"{getattr(config, name)!r} yet; drop one of the two."
                )
