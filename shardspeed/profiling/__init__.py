"""Profiling: the flops profiler and the training-loop timers.

* :mod:`shardspeed.profiling.flops_profiler` - ``get_model_profile``, ``FlopsProfiler``.
* :mod:`shardspeed.profiling.timers` - ``Timers``, ``ThroughputTimer``.
"""

from __future__ import annotations

from shardspeed.profiling.timers import ENGINE_TIMER_NAMES, ThroughputTimer, Timer, Timers

__all__ = ["ENGINE_TIMER_NAMES", "ThroughputTimer", "Timer", "Timers"]
