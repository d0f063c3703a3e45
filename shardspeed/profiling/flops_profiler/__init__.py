"""Flops profiler (DeepSpeed's ``deepspeed.profiling.flops_profiler``).

``get_model_profile(model, args=[...])`` for a one-off profile; ``FlopsProfiler`` to
profile a window of a training loop (the engine does this at ``flops_profiler.profile_step``).
"""

from __future__ import annotations

from shardspeed.profiling.flops_profiler.api import get_model_profile
from shardspeed.profiling.flops_profiler.counter import FlopCountMode
from shardspeed.profiling.flops_profiler.peak import PEAK_BF16_FLOPS, mfu, peak_bf16_flops
from shardspeed.profiling.flops_profiler.profiler import FlopsProfiler, ModuleStats
from shardspeed.profiling.flops_profiler.report import (
    duration_to_string,
    flops_to_string,
    macs_to_string,
    number_to_string,
    params_to_string,
)

__all__ = [
    "PEAK_BF16_FLOPS",
    "FlopCountMode",
    "FlopsProfiler",
    "ModuleStats",
    "duration_to_string",
    "flops_to_string",
    "get_model_profile",
    "macs_to_string",
    "mfu",
    "number_to_string",
    "params_to_string",
    "peak_bf16_flops",
]
