"""DeepSpeed's ``TensorBoardMonitor`` (``deepspeed.monitor.tensorboard``) on ``TensorBoardWriter``.

Scalars go to a ``SummaryWriter`` in ``<output_path>/<job_name>`` (``./runs/<job_name>``
when ``output_path`` is empty), on the global rank 0 only. An enabled monitor without the
``tensorboard`` package raises ``ValueError`` saying what to install.
"""

from __future__ import annotations

from typing import Any

from shardspeed.monitor.config import monitor_settings
from shardspeed.monitor.monitor import _check_installed, _global_rank
from shardspeed.monitor.writers import Event, TensorBoardWriter


class TensorBoardMonitor:
    """TensorBoard scalars from ``(name, value, step)`` events.

    ``tensorboard_config``: the ``tensorboard`` block, as a dict or an object with
    ``enabled``, ``output_path`` and ``job_name``.
    """

    def __init__(self, tensorboard_config: Any) -> None:
        self.monitor_config = tensorboard_config
        settings = monitor_settings({"tensorboard": tensorboard_config})["tensorboard"]
        self.enabled = settings.enabled
        self.output_path = settings.output_path
        self.job_name = settings.job_name
        self._settings = settings
        self._writer: TensorBoardWriter | None = None
        if self.enabled:
            _check_installed("tensorboard")
            self.get_summary_writer()

    @property
    def summary_writer(self) -> Any:
        """The ``torch.utils.tensorboard.SummaryWriter`` (None off rank 0 or when disabled)."""
        return self._writer.writer if self._writer is not None else None

    def get_summary_writer(self) -> Any:
        """Create the writer on rank 0 (once) and return it."""
        if self.enabled and self._writer is None and _global_rank() == 0:
            self._writer = TensorBoardWriter(self._settings)
        return self.summary_writer

    def write_events(self, event_list: list[Event], flush: bool = True) -> None:
        """Add each ``(name, value, step)`` as a scalar; flush unless ``flush=False``."""
        if self._writer is None:
            return
        if flush:
            self._writer.write(list(event_list))
        else:
            for name, value, step in event_list:
                self._writer.writer.add_scalar(name, value, step)

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.writer.flush()
