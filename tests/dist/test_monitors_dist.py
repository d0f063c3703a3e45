"""In a 2-rank run only global rank 0 writes monitor files."""

from __future__ import annotations

import csv
import json

import torch.distributed as dist

from shardspeed.testing import run_distributed


def _write_events(root: str) -> dict:
    from shardspeed.monitor import MonitorMaster

    rank = dist.get_rank()
    config = {
        "csv_monitor": {"enabled": True, "output_path": f"{root}/csv", "job_name": "job"},
        "jsonl_monitor": {"enabled": True, "output_path": f"{root}/jsonl", "job_name": "job"},
    }
    monitor = MonitorMaster(config)
    for step in (4, 8):
        # Each rank reports its own value; only rank 0's may reach the files.
        monitor.write_events(
            [
                ("Train/Samples/train_loss", 10.0 * (rank + 1) + step, step),
                ("Train/Samples/lr", 0.5 * (rank + 1), step),
            ]
        )
    dist.barrier()
    monitor.close()
    return {"rank": rank, "enabled": monitor.enabled}


def test_only_rank0_writes_csv_and_jsonl(tmp_path):
    results = run_distributed(_write_events, 2, str(tmp_path), timeout=60)
    assert [r["enabled"] for r in results] == [True, True]

    csv_dir = tmp_path / "csv" / "job"
    assert sorted(p.name for p in csv_dir.iterdir()) == [
        "Train_Samples_lr.csv",
        "Train_Samples_train_loss.csv",
    ]
    with open(csv_dir / "Train_Samples_train_loss.csv", newline="") as f:
        assert list(csv.reader(f)) == [["step", "train_loss"], ["4", "14.0"], ["8", "18.0"]]
    with open(csv_dir / "Train_Samples_lr.csv", newline="") as f:
        assert list(csv.reader(f)) == [["step", "lr"], ["4", "0.5"], ["8", "0.5"]]

    records = [
        json.loads(x)
        for x in (tmp_path / "jsonl" / "job" / "events.jsonl").read_text().splitlines()
    ]
    assert [(r["tag"], r["value"], r["step"]) for r in records] == [
        ("Train/Samples/train_loss", 14.0, 4),
        ("Train/Samples/lr", 0.5, 4),
        ("Train/Samples/train_loss", 18.0, 8),
        ("Train/Samples/lr", 0.5, 8),
    ]
