"""Speculative decoding for FastGen: draft-model and n-gram (prompt-lookup) proposals
verified by the target in one forward per decode step, with rejection sampling.

* :mod:`.config`: ``EngineConfig.speculative_config`` (vLLM's keys).
* :mod:`.proposal`: the proposer interface; :mod:`.draft_model` and :mod:`.ngram`.
* :mod:`.rejection`: greedy verification and speculative rejection sampling.
* :mod:`.lookahead`: KV slots reserved for the proposals and rolled back after.
* :mod:`.decoder`: one speculative engine step (the engine's hook).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardspeed.inference.fastgen.speculative.config import SPECULATIVE_METHODS, SpeculativeConfig
from shardspeed.inference.fastgen.speculative.decoder import SpeculativeDecoder, SpeculativeStats
from shardspeed.inference.fastgen.speculative.ngram import NgramProposer, lookup_ngram
from shardspeed.inference.fastgen.speculative.proposal import Proposal, Proposer

if TYPE_CHECKING:
    from shardspeed.inference.fastgen.engine import InferenceEngine

__all__ = [
    "SPECULATIVE_METHODS",
    "NgramProposer",
    "Proposal",
    "Proposer",
    "SpeculativeConfig",
    "SpeculativeDecoder",
    "SpeculativeStats",
    "build_speculator",
    "lookup_ngram",
]


def build_speculator(engine: InferenceEngine) -> SpeculativeDecoder | None:
    """The engine's speculative decoder from ``engine.config.speculative_config`` (None: off)."""
    config = engine.config.speculative_config
    if config is None:
        return None
    proposer: Proposer
    if config.method == "ngram":
        proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    else:
        from shardspeed.inference.fastgen.speculative.draft_model import DraftModelProposer

        proposer = DraftModelProposer(
            config, engine.model, engine.kv_cache.spec, engine.block_pool.num_blocks,
            engine.device, engine.config.attention_backend, engine.config.cpu_prepack,
        )  # fmt: skip
    return SpeculativeDecoder(config, engine, proposer)
