"""Event writers: CSV (DeepSpeed's file layout), JSON lines, TensorBoard, Weights & Biases.

Each writer takes ``[(tag, value, step), ...]``. Only the global rank 0 constructs them.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, TextIO

from shardspeed.monitor.config import BackendSettings

Event = tuple[str, Any, int]


def to_number(value: Any) -> float | int:
    """Plain Python number from a float / int / 0-d tensor / numpy scalar."""
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, bool):
        return int(value)
    if not isinstance(value, (int, float)):
        raise ValueError(
            f"monitor event value must be a number or a one-element tensor, got {type(value).__name__}"
        )
    return value


def log_dir(settings: BackendSettings, default_root: str) -> Path:
    """``<output_path>/<job_name>``; an empty output_path means ``./<default_root>``."""
    root = settings.output_path or default_root
    return Path(os.path.expanduser(root)) / settings.job_name


class CsvWriter:
    """One CSV per tag: ``<dir>/<tag with '/' -> '_'>.csv``, header ``step,<last tag part>``."""

    def __init__(self, settings: BackendSettings) -> None:
        self.dir = log_dir(settings, "csv_monitor")
        self.dir.mkdir(parents=True, exist_ok=True)
        self._files: dict[str, TextIO] = {}

    def _file(self, tag: str) -> TextIO:
        handle = self._files.get(tag)
        if handle is None:
            path = self.dir / f"{tag.replace('/', '_')}.csv"
            new = not path.exists() or path.stat().st_size == 0
            handle = open(path, "a", encoding="utf-8", newline="")  # noqa: SIM115 - kept open
            if new:
                handle.write(f"step,{tag.split('/')[-1]}\n")
            self._files[tag] = handle
        return handle

    def write(self, events: list[Event]) -> None:
        touched = set()
        for tag, value, step in events:
            self._file(tag).write(f"{int(step)},{to_number(value)}\n")
            touched.add(tag)
        for tag in touched:
            self._files[tag].flush()

    def close(self) -> None:
        for handle in self._files.values():
            handle.close()
        self._files = {}


class JsonlWriter:
    """All events in ``<dir>/events.jsonl``: ``{"tag", "value", "step", "time"}`` per line."""

    def __init__(self, settings: BackendSettings) -> None:
        self.dir = log_dir(settings, "jsonl_monitor")
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "events.jsonl"
        self._handle: TextIO | None = open(self.path, "a", encoding="utf-8")  # noqa: SIM115

    def write(self, events: list[Event]) -> None:
        assert self._handle is not None, "JsonlWriter used after close()"
        now = time.time()
        for tag, value, step in events:
            record = {"tag": tag, "value": to_number(value), "step": int(step), "time": now}
            self._handle.write(json.dumps(record) + "\n")
        self._handle.flush()

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None


class TensorBoardWriter:
    """``torch.utils.tensorboard.SummaryWriter`` in ``<output_path>/<job_name>``."""

    def __init__(self, settings: BackendSettings) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.dir = log_dir(settings, "runs")
        self.writer = SummaryWriter(log_dir=str(self.dir))

    def write(self, events: list[Event]) -> None:
        for tag, value, step in events:
            self.writer.add_scalar(tag, to_number(value), int(step))
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbWriter:
    """Weights & Biases run (``project``, ``group``, ``team`` as entity, ``job_name`` as name)."""

    def __init__(self, settings: BackendSettings) -> None:
        import wandb

        self.wandb = wandb
        self.run = wandb.init(
            project=settings.project,
            group=settings.group,
            entity=settings.team,
            name=settings.job_name if settings.job_name != "DeepSpeedJobName" else None,
        )

    def write(self, events: list[Event]) -> None:
        for tag, value, step in events:
            self.wandb.log({tag: to_number(value)}, step=int(step))

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
