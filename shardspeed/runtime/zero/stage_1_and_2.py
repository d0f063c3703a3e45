"""``deepspeed.runtime.zero.stage_1_and_2`` path: the ZeRO-1/2 memory estimators."""

from __future__ import annotations

from shardspeed.zero.estimate import (
    estimate_zero2_model_states_mem_needs,
    estimate_zero2_model_states_mem_needs_all_cold,
    estimate_zero2_model_states_mem_needs_all_live,
)

__all__ = [
    "estimate_zero2_model_states_mem_needs",
    "estimate_zero2_model_states_mem_needs_all_cold",
    "estimate_zero2_model_states_mem_needs_all_live",
]
