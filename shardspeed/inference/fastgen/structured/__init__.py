"""Structured output for FastGen: JSON schema, JSON object, regex, grammar and choice
constraints enforced by token masks (llguidance) inside the continuous batch.

``SamplingParams(structured_output=StructuredOutputParams(json=schema))`` makes a
request's output match ``schema``: the engine compiles a :class:`Guide` when the request
is added, masks the request's logits row every step (:func:`apply_guides`; the step's
masks are computed on a worker thread while its forward runs, :class:`MaskPrefetcher`)
and advances the guide with each sampled token; a request ends with
``finish_reason="stop"`` as soon as its grammar is complete.
"""

from shardspeed.inference.fastgen.structured.guide import Guide, GuideFactory
from shardspeed.inference.fastgen.structured.masks import apply_guides
from shardspeed.inference.fastgen.structured.params import StructuredOutputParams
from shardspeed.inference.fastgen.structured.prefetch import MaskPrefetcher

__all__ = ["Guide", "GuideFactory", "MaskPrefetcher", "StructuredOutputParams", "apply_guides"]
