"""DeepSpeed's ``WandbMonitor`` (``deepspeed.monitor.wandb``) over :class:`WandbWriter`.

One Weights & Biases run (``project``, ``group``, ``team`` as entity) started on the global
rank 0. An enabled monitor without the ``wandb`` package raises ``ValueError`` saying what
to install.
"""

from __future__ import annotations

from typing import Any

from shardspeed.monitor.config import monitor_settings
from shardspeed.monitor.monitor import _check_installed, _global_rank
from shardspeed.monitor.writers import Event, WandbWriter


class WandbMonitor:
    """Weights & Biases logging of ``(name, value, step)`` events.

    ``wandb_config``: the ``wandb`` block, as a dict or an object with ``enabled``,
    ``project``, ``group`` and ``team``.
    """

    def __init__(self, wandb_config: Any) -> None:
        self.monitor_config = wandb_config
        settings = monitor_settings({"wandb": wandb_config})["wandb"]
        self.enabled = settings.enabled
        self.group = settings.group
        self.team = settings.team
        self.project = settings.project
        self._writer: WandbWriter | None = None
        if self.enabled:
            _check_installed("wandb")
            if _global_rank() == 0:
                self._writer = WandbWriter(settings)

    def log(self, data: dict[str, Any], step: int | None = None, commit: bool | None = None) -> Any:
        """``wandb.log(data, step=step, commit=commit)`` on rank 0."""
        if self._writer is not None:
            return self._writer.wandb.log(data, step=step, commit=commit)
        return None

    def write_events(self, event_list: list[Event]) -> None:
        """Log each ``(name, value, step)``."""
        if self._writer is not None and event_list:
            self._writer.write(list(event_list))
