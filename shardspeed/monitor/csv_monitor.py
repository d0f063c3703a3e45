"""DeepSpeed's ``csvMonitor`` (``deepspeed.monitor.csv_monitor``) over :class:`CsvWriter`.

One CSV per event name under ``<output_path>/<job_name>`` (``./csv_monitor/<job_name>``
when ``output_path`` is empty), header ``step,<last part of the name>``. Only the global
rank 0 creates files; elsewhere ``write_events`` does nothing.
"""

from __future__ import annotations

from typing import Any

from shardspeed.monitor.config import monitor_settings
from shardspeed.monitor.monitor import _global_rank
from shardspeed.monitor.writers import CsvWriter, Event


class csvMonitor:  # noqa: N801 - DeepSpeed's name
    """CSV files of ``(name, value, step)`` events.

    ``csv_config``: the ``csv_monitor`` block, as a dict or an object with ``enabled``,
    ``output_path`` and ``job_name``.
    """

    def __init__(self, csv_config: Any) -> None:
        self.monitor_config = csv_config
        settings = monitor_settings({"csv_monitor": csv_config})["csv_monitor"]
        self.enabled = settings.enabled
        self.output_path = settings.output_path
        self.job_name = settings.job_name
        self._writer: CsvWriter | None = None
        if self.enabled and _global_rank() == 0:
            self._writer = CsvWriter(settings)
        self.log_dir: str | None = str(self._writer.dir) if self._writer else None

    @property
    def filenames(self) -> list[str]:
        """File names (without ``.csv``) written so far."""
        if self._writer is None:
            return []
        return [tag.replace("/", "_") for tag in self._writer._files]

    def write_events(self, event_list: list[Event]) -> None:
        """Append each ``(name, value, step)`` to ``<log_dir>/<name with / -> _>.csv``."""
        if self._writer is not None and event_list:
            self._writer.write(list(event_list))

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
