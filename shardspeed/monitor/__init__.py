"""Training monitors: CSV, JSON lines, TensorBoard and Weights & Biases.

``MonitorMaster(config).write_events([(tag, value, step), ...])``; see
``docs/observability.md`` for the file layout and the events the engine emits.
"""

from __future__ import annotations

from shardspeed.monitor.config import BACKENDS, BackendSettings, monitor_settings
from shardspeed.monitor.monitor import MonitorMaster
from shardspeed.monitor.writers import CsvWriter, JsonlWriter, TensorBoardWriter, WandbWriter

__all__ = [
    "BACKENDS",
    "BackendSettings",
    "CsvWriter",
    "JsonlWriter",
    "MonitorMaster",
    "TensorBoardWriter",
    "WandbWriter",
    "monitor_settings",
]
