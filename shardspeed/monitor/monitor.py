"""``MonitorMaster``: fan training events out to the enabled monitor backends (rank 0 only)."""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Any

from shardspeed.monitor.config import BackendSettings, monitor_settings
from shardspeed.monitor.writers import (
    CsvWriter,
    Event,
    JsonlWriter,
    TensorBoardWriter,
    WandbWriter,
)

_WRITERS = {
    "tensorboard": TensorBoardWriter,
    "csv_monitor": CsvWriter,
    "jsonl_monitor": JsonlWriter,
    "wandb": WandbWriter,
}
# backend -> (module that must import, pip package that provides it)
_REQUIREMENTS = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
}


def _global_rank() -> int:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except ImportError:  # pragma: no cover
        pass
    return int(os.environ.get("RANK", "0"))


def _check_installed(name: str) -> None:
    module, package = _REQUIREMENTS.get(name, (None, None))
    if module is None or module in sys.modules:
        return
    if importlib.util.find_spec(module) is None:
        raise ValueError(
            f"{name}.enabled is true but the {module!r} package is not installed; "
            f"run `pip install {package}` or set {name}.enabled to false."
        )


def _reject_comet(config: Any) -> None:
    """Comet is a DeepSpeed back-end we do not implement: refuse rather than drop events."""
    block = config.get("comet") if isinstance(config, dict) else getattr(config, "comet", None)
    enabled = block.get("enabled") if isinstance(block, dict) else getattr(block, "enabled", False)
    if enabled:
        raise ValueError(
            "comet.enabled is true but ShardSpeed has no Comet monitor; set comet.enabled to "
            "false and use wandb, tensorboard, csv_monitor or jsonl_monitor instead."
        )


class MonitorMaster:
    """Write ``(tag, value, step)`` events to every enabled backend.

    ``config``: an object with ``tensorboard``, ``csv_monitor``, ``wandb`` and
    ``jsonl_monitor`` sub-objects (each with ``enabled``, ``output_path``, ``job_name``;
    wandb also ``project``, ``group``, ``team``), or a ds_config dict. A backend that is
    enabled but whose package is missing raises ``ValueError`` here, on every rank.
    Only the global rank 0 creates files or runs; on other ranks ``write_events`` is a no-op.
    """

    def __init__(self, config: Any) -> None:
        _reject_comet(config)
        self.settings: dict[str, BackendSettings] = monitor_settings(config)
        enabled = [name for name, s in self.settings.items() if s.enabled]
        for name in enabled:
            _check_installed(name)
        self.enabled = bool(enabled)
        self.rank = _global_rank()
        self.writers: dict[str, Any] = {}
        if self.rank == 0:
            self.writers = {name: _WRITERS[name](self.settings[name]) for name in enabled}

    def write_events(self, event_list: list[Event]) -> None:
        """Record each ``(tag, value, step)``; ``step`` is usually the global sample count."""
        if not self.writers or not event_list:
            return
        events = list(event_list)
        for writer in self.writers.values():
            writer.write(events)

    def close(self) -> None:
        """Flush and close every backend."""
        for writer in self.writers.values():
            writer.close()
        self.writers = {}

    def __enter__(self) -> MonitorMaster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
