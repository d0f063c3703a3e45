"""MII's generation keywords and defaults, checked once for both the pipeline and the client."""

from __future__ import annotations

from typing import Any

MII_DEFAULTS: dict[str, Any] = {"do_sample": True, "top_p": 0.9, "min_new_tokens": 0}
MII_KWARGS = frozenset(
    {
        "max_length",
        "max_new_tokens",
        "min_new_tokens",
        "do_sample",
        "top_p",
        "top_k",
        "temperature",
        "stop",
        "ignore_eos",
        "return_full_text",
        "stream",
    }
)
# ShardSpeed extensions accepted on top of MII's keywords.
EXTRA_KWARGS = frozenset(
    {"seed", "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias"}
)


def mii_generation_kwargs(kwargs: dict[str, Any], where: str) -> dict[str, Any]:
    """``kwargs`` with MII's defaults filled in; unknown keys raise ``ValueError``."""
    unknown = sorted(set(kwargs) - MII_KWARGS - EXTRA_KWARGS)
    if unknown:
        raise ValueError(
            f"{where} got unknown generation keyword(s) {unknown}; MII's are "
            f"{sorted(MII_KWARGS)} (ShardSpeed adds {sorted(EXTRA_KWARGS)})."
        )
    if kwargs.get("stream"):
        raise ValueError(
            f"{where}(stream=True) is not supported; use MIIClient.generate(..., "
            "streaming_fn=callback) or Pipeline.stream()."
        )
    merged = {**MII_DEFAULTS, **{k: v for k, v in kwargs.items() if k != "stream"}}
    if merged.get("top_k") is None:
        merged.pop("top_k", None)
    if not merged["do_sample"]:
        merged.pop("top_p")  # greedy: MII's sampling default does not apply
    return merged
