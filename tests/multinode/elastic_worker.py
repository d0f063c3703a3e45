"""The training script of the elastic drills (``test_elastic_drill.py``), and its reference.

Under ``shardspeed --elastic`` (one torchrun agent per host): ``python elastic_worker.py
OUT_DIR`` trains the parity GPT at ZeRO 3 for :data:`STEPS` optimizer steps with the
``elasticity`` block below (global batch 2 at world 1 or 2: micro 1, GAS 2 or 1), samples
from a ``DistributedSampler`` loader that resumes exactly, and a checkpoint every
:data:`SAVE_EVERY` steps into ``OUT_DIR/ckpt`` (both hosts see it). Every start of the
script (torchrun restarts it when the membership changes) first calls ``resume_elastic``.

The drill's events are driven from here, so they happen at a known step:

* at step :data:`LOSE_AT` of the first world-2 attempt, host B's rank writes
  ``OUT_DIR/lose_B`` and sleeps until the test SIGKILLs host B; host A's rank waits in a
  barrier, which fails when host B is gone;
* with ``SHARDSPEED_TEST_DRILL=rejoin`` (``SHARDSPEED_*`` variables reach every host), at
  step :data:`REJOIN_AT` of the world-1 attempt rank 0 writes ``OUT_DIR/rejoin_B`` and
  waits for the agent to restart it when host B is back.

Rank 0 appends one JSON line per step (and per resume) to ``OUT_DIR/events.jsonl``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from parity_common import ParitySpec, make_model

STEPS = 20
SAVE_EVERY = 5
LOSE_AT = 7
REJOIN_AT = 12
SAMPLES = 64
SPEC = ParitySpec(stage=3, world=1, micro=1, steps=STEPS)


def config() -> dict[str, Any]:
    cfg = SPEC.config()
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        cfg.pop(key)  # the elasticity block sets them for the world size
    cfg["zero_optimization"] = {"stage": 3, "stage3_param_persistence_threshold": 20}
    cfg["elasticity"] = {
        "enabled": True,
        "max_train_batch_size": 2,
        "micro_batch_sizes": [1],
        "min_gpus": 1,
        "max_gpus": 2,
        "version": 0.2,
    }
    return cfg


def dataset() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(99)
    return torch.utils.data.TensorDataset(
        torch.randint(0, 32, (SAMPLES, SPEC.seq + 1), generator=g)
    )


def _event(out: Path, **fields: Any) -> None:
    with open(out / "events.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps(fields) + "\n")


def train(ckpt: Path, stop_at: int = STEPS, out: Path | None = None) -> dict[str, Any]:
    """Resume from ``ckpt``'s latest tag (if any) and train to ``stop_at``; saves there."""
    import shardspeed
    from shardspeed import comm
    from shardspeed.runtime.dataloader import ShardSpeedDataLoader
    from shardspeed.runtime.elastic_resume import resume_elastic

    engine, _, _, _ = shardspeed.initialize(model=make_model(SPEC), config=config())
    rank, world = comm.get_rank(), comm.get_world_size()
    loader = ShardSpeedDataLoader(dataset(), engine.train_micro_batch_size_per_gpu(),
                                  dp_world_size=world, dp_rank=rank, exact_resume=True)  # fmt: skip
    resumed = resume_elastic(engine, ckpt, data_loader=loader)
    host = os.environ.get("SS_TEST_HOST", "?")
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if out is not None and rank == 0:
        _event(out, kind="start", world=world, restart=restart, host=host,
               resumed_at=resumed.global_steps if resumed else None,
               changes=resumed.changes() if resumed else None)  # fmt: skip
    gas = engine.gradient_accumulation_steps()
    batches = iter(loader)
    losses: dict[int, float] = {}
    while engine.global_steps < stop_at:
        total = torch.zeros((), dtype=torch.float64)
        for _ in range(gas):
            (tokens,) = next(batches)
            _, loss = engine(tokens[:, :-1], tokens[:, 1:])
            engine.backward(loss)
            engine.step()
            total += float(loss.detach())
        comm.all_reduce(total)
        step = engine.global_steps
        losses[step] = float(total) / (world * gas)
        if out is not None and rank == 0:
            _event(out, kind="step", step=step, world=world, loss=losses[step], host=host)
        if step % SAVE_EVERY == 0:
            engine.save_checkpoint(str(ckpt))
        if out is not None:
            _drill_events(out, step, world, resumed is None, host)
    engine.destroy()
    return {"losses": losses, "world": world}


def _drill_events(out: Path, step: int, world: int, first_attempt: bool, host: str) -> None:
    from shardspeed import comm

    if step == LOSE_AT and world == 2 and first_attempt:
        if host == "B":  # its step event (if rank 0) is written: the test may kill it now
            (out / "lose_B").write_text(str(step))
            time.sleep(600)
        comm.barrier()  # fails once host B is gone: torchrun restarts this worker
    if step == REJOIN_AT and world == 1 and os.environ.get("SHARDSPEED_TEST_DRILL") == "rejoin":
        (out / "rejoin_B").write_text(str(step))
        time.sleep(300)  # the agent restarts this worker at world 2 when host B is back


def reference(ckpt: str, stop_at: int) -> dict[str, Any]:
    """The uninterrupted run: resume from ``ckpt`` (one tag) on this process group."""
    return train(Path(ckpt), stop_at)


if __name__ == "__main__":
    out_dir = Path(sys.argv[-1])
    train(out_dir / "ckpt", STEPS, out_dir)
