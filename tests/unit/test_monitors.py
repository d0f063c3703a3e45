"""Monitors (CSV, JSONL, TensorBoard / wandb gating) and rank-aware progress output."""

from __future__ import annotations

import csv
import json
import logging
import sys
import types
from types import SimpleNamespace

import pytest
import torch

from shardspeed.monitor import MonitorMaster
from shardspeed.utils import progress as progress_mod
from shardspeed.utils.progress import progress

EVENTS = [
    ("Train/Samples/train_loss", torch.tensor(2.5), 8),
    ("Train/Samples/lr", 1e-3, 8),
    ("Train/Samples/train_loss", 2.25, 16),
]


def _csv_rows(path):
    with open(path, newline="") as f:
        return list(csv.reader(f))


def test_csv_and_jsonl_from_dict_config(tmp_path):
    config = {
        "csv_monitor": {"enabled": True, "output_path": str(tmp_path / "csv"), "job_name": "run1"},
        "jsonl_monitor": {"enabled": True, "output_path": str(tmp_path / "jl"), "job_name": "run1"},
        "tensorboard": {"enabled": False},
    }
    with MonitorMaster(config) as monitor:
        assert monitor.enabled
        monitor.write_events(EVENTS)

    loss = tmp_path / "csv" / "run1" / "Train_Samples_train_loss.csv"
    assert _csv_rows(loss) == [["step", "train_loss"], ["8", "2.5"], ["16", "2.25"]]
    assert _csv_rows(tmp_path / "csv" / "run1" / "Train_Samples_lr.csv") == [
        ["step", "lr"],
        ["8", "0.001"],
    ]
    lines = (tmp_path / "jl" / "run1" / "events.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [(r["tag"], r["value"], r["step"]) for r in records] == [
        ("Train/Samples/train_loss", 2.5, 8),
        ("Train/Samples/lr", 0.001, 8),
        ("Train/Samples/train_loss", 2.25, 16),
    ]
    assert all(isinstance(r["time"], float) for r in records)

    # A resumed run appends without repeating the header.
    with MonitorMaster(config) as monitor:
        monitor.write_events([("Train/Samples/train_loss", 2.0, 24)])
    assert _csv_rows(loss)[-2:] == [["16", "2.25"], ["24", "2.0"]]
    assert _csv_rows(loss).count(["step", "train_loss"]) == 1


def test_object_config_disabled_and_bad_values(tmp_path):
    off = SimpleNamespace(enabled=False, output_path="", job_name="x")
    cfg = SimpleNamespace(
        tensorboard=off,
        wandb=SimpleNamespace(enabled=False, project="p", group=None, team=None),
        csv_monitor=SimpleNamespace(enabled=True, output_path=str(tmp_path), job_name="obj"),
    )  # no jsonl_monitor attribute: treated as disabled
    monitor = MonitorMaster(cfg)
    assert monitor.enabled and list(monitor.writers) == ["csv_monitor"]
    with pytest.raises(ValueError, match="one-element tensor"):
        monitor.write_events([("Train/Samples/lr", "high", 1)])
    monitor.close()

    nothing = MonitorMaster({})
    assert not nothing.enabled
    nothing.write_events(EVENTS)  # no-op

    with pytest.raises(ValueError, match="csv_monitor.output_dir.*did you mean 'output_path'"):
        MonitorMaster({"csv_monitor": {"enabled": True, "output_dir": "x"}})
    with pytest.raises(ValueError, match="comet.enabled is true"):
        MonitorMaster({"comet": {"enabled": True}})


def test_missing_tensorboard_or_wandb_raises_with_install_hint(monkeypatch):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name in ("tensorboard", "wandb") else real_find_spec(name, *a),
    )
    monkeypatch.delitem(sys.modules, "tensorboard", raising=False)
    monkeypatch.delitem(sys.modules, "wandb", raising=False)
    with pytest.raises(ValueError, match="pip install tensorboard"):
        MonitorMaster({"tensorboard": {"enabled": True}})
    with pytest.raises(ValueError, match="pip install wandb"):
        MonitorMaster({"wandb": {"enabled": True, "project": "p"}})


def test_tensorboard_and_wandb_writers_with_stub_packages(tmp_path, monkeypatch):
    scalars, logged, inits = [], [], []

    class StubWriter:
        def __init__(self, log_dir):
            self.log_dir = log_dir

        def add_scalar(self, tag, value, step):
            scalars.append((self.log_dir, tag, value, step))

        def flush(self):
            pass

        def close(self):
            pass

    tb_module = types.ModuleType("torch.utils.tensorboard")
    tb_module.SummaryWriter = StubWriter
    wandb_module = types.ModuleType("wandb")
    wandb_module.init = lambda **kw: inits.append(kw) or SimpleNamespace(finish=lambda: None)
    wandb_module.log = lambda data, step: logged.append((data, step))
    monkeypatch.setitem(sys.modules, "tensorboard", types.ModuleType("tensorboard"))
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", tb_module)
    monkeypatch.setitem(sys.modules, "wandb", wandb_module)

    config = {
        "tensorboard": {"enabled": True, "output_path": str(tmp_path), "job_name": "tb"},
        "wandb": {"enabled": True, "project": "proj", "group": "g", "team": "t"},
    }
    with MonitorMaster(config) as monitor:
        monitor.write_events(EVENTS[:2])
    assert scalars == [
        (str(tmp_path / "tb"), "Train/Samples/train_loss", 2.5, 8),
        (str(tmp_path / "tb"), "Train/Samples/lr", 1e-3, 8),
    ]
    assert inits == [{"project": "proj", "group": "g", "entity": "t", "name": None}]
    assert logged == [({"Train/Samples/train_loss": 2.5}, 8), ({"Train/Samples/lr": 1e-3}, 8)]


# ----------------------------------------------------------------------- progress


@pytest.fixture
def progress_log():
    records: list[str] = []

    class Grab(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    handler = Grab()
    progress_mod.logger.addHandler(handler)
    yield records
    progress_mod.logger.removeHandler(handler)


def test_progress_logs_every_ten_percent_without_tty(monkeypatch, progress_log):
    monkeypatch.setattr(progress_mod, "_stderr_is_tty", lambda: False)
    monkeypatch.setenv("RANK", "0")
    items = []
    bar = progress(range(50), desc="train", unit="step")
    assert bar.mode == "log" and len(bar) == 50
    for i in bar:
        items.append(i)
        bar.set_postfix(loss=1.0 / (i + 1))
    assert items == list(range(50))
    assert len(progress_log) == 10
    assert progress_log[0].startswith("train:  10% (5/50 step)")
    assert progress_log[-1].startswith("train: 100% (50/50 step)")
    assert "loss=0.02" in progress_log[-1]


def test_progress_tty_bar_other_ranks_and_disable(monkeypatch, progress_log):
    monkeypatch.setattr(progress_mod, "_stderr_is_tty", lambda: True)
    monkeypatch.setenv("RANK", "0")
    with progress(total=3, desc="load") as bar:
        assert bar.mode == "bar"
        bar.update(2)
        bar.set_postfix({"ok": 1})
        bar.update(1)
    assert bar.n == 3 and progress_log == []

    monkeypatch.setenv("RANK", "1")
    quiet = progress(total=10)
    assert quiet.mode == "off"
    quiet.update(10)
    quiet.set_postfix(a=1)
    assert progress_log == []

    monkeypatch.setenv("RANK", "0")
    assert progress(total=1, disable=True).mode == "off"
    monkeypatch.setattr(progress_mod, "_stderr_is_tty", lambda: False)
    forced = progress(total=1, disable=False)
    assert forced.mode == "bar"
    forced.close()
