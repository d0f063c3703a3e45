"""Training monitors: CSV, JSON lines, TensorBoard and Weights & Biases.

``MonitorMaster(config).write_events([(tag, value, step), ...])``; one back-end alone under
DeepSpeed's names: ``csvMonitor``, ``TensorBoardMonitor``, ``WandbMonitor``. See
``docs/observability.md`` for the file layout and the events the engine emits.
"""

from __future__ import annotations

from shardspeed.monitor.config import BACKENDS, BackendSettings, monitor_settings
from shardspeed.monitor.csv_monitor import csvMonitor
from shardspeed.monitor.monitor import MonitorMaster
from shardspeed.monitor.tensorboard import TensorBoardMonitor
from shardspeed.monitor.wandb import WandbMonitor
from shardspeed.monitor.writers import CsvWriter, JsonlWriter, TensorBoardWriter, WandbWriter

__all__ = [
    "BACKENDS",
    "BackendSettings",
    "CsvWriter",
    "JsonlWriter",
    "MonitorMaster",
    "TensorBoardMonitor",
    "TensorBoardWriter",
    "WandbMonitor",
    "WandbWriter",
    "csvMonitor",
    "monitor_settings",
]
