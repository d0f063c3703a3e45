"""``mii.pipeline``: the in-process pipeline with MII's generation defaults."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from shardspeed.inference.serving.pipeline import Pipeline, Prompt, Response
from shardspeed.inference.serving.pipeline import pipeline as _shardspeed_pipeline
from shardspeed.mii.kwargs import mii_generation_kwargs


class MIIPipeline(Pipeline):
    """A :class:`Pipeline` whose call takes MII's keywords with MII's defaults.

    Without ``max_new_tokens`` or ``max_length`` each prompt generates up to the
    engine's context (MII's ``max_length`` default), stopping there instead of raising.
    """

    is_rank_0 = True  # one process serves the model (MII's multi-rank flag)

    def __call__(self, prompts: str | Sequence[Prompt], **kwargs: Any) -> list[Response]:  # type: ignore[override]
        gen = mii_generation_kwargs(kwargs, "MIIPipeline")
        if gen.get("max_new_tokens") is None and gen.get("max_length") is None:
            gen["max_length"] = self.engine.max_seq_len
            gen["truncate"] = True
        return super().__call__(prompts, **gen)


def pipeline(
    model_name_or_path: Any, tokenizer: Any = None, tensor_parallel: int = 1, **engine_config: Any
) -> MIIPipeline:
    """Load ``model_name_or_path`` (anything :func:`shardspeed.inference.serving.pipeline`
    takes) into an :class:`MIIPipeline`; ``engine_config`` are ``EngineConfig`` fields."""
    if tensor_parallel != 1:
        raise ValueError(
            f"mii.pipeline(tensor_parallel={tensor_parallel!r}) is not supported: the FastGen "
            "engine runs on one device; pass tensor_parallel=1."
        )
    base = _shardspeed_pipeline(model_name_or_path, tokenizer=tokenizer, **engine_config)
    return MIIPipeline(base.engine)
