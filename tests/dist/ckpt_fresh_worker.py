"""torchrun worker of ``test_checkpoint_fresh.py`` (not a test module itself).

``python -m torch.distributed.run --nproc-per-node 2 ckpt_fresh_worker.py PHASE OUT``

* ``train``: for every ZeRO stage 0-3 x fp32/bf16 (dropout, shuffled engine dataloader,
  WarmupLR): 10 straight steps, then a new engine trains 4 steps and saves
  ``OUT/s{stage}_{precision}``. Then the last engine trains one more step and saves again,
  and rank 1 SIGKILLs itself halfway through writing its safetensors file.
* ``resume``: fresh processes; every configuration is loaded into an engine built from
  another seed (the global RNG reseeded too) and trains 6 steps.

Each rank writes its losses (JSON) and final parameters (safetensors) under ``OUT``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from datetime import timedelta
from pathlib import Path

import torch
from safetensors.torch import save, save_file
from test_checkpoint_engine import _dropout_engine, _forever, _params, _train

import shardspeed
from shardspeed import comm
from shardspeed.checkpoint import commit, load_checkpoint

CONFIGS = [(stage, precision) for stage in (0, 1, 2, 3) for precision in ("fp32", "bf16")]
PG_TIMEOUT = timedelta(seconds=20)  # survivors of a killed rank give up after this


def _die_halfway(tensors: dict[str, torch.Tensor], path: object, *args: object, **kw: object) -> None:
    data = save(tensors)
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2])
        f.flush()
        os.fsync(f.fileno())
    os.kill(os.getpid(), signal.SIGKILL)


def _train_phase(out: Path, rank: int) -> None:
    losses: dict[str, list[float]] = {}
    params: dict[str, torch.Tensor] = {}
    engine = None
    for stage, precision in CONFIGS:
        name = f"s{stage}_{precision}"
        torch.manual_seed(100 + rank)
        engine, loader = _dropout_engine(stage, precision, seed=1)
        losses[f"{name}/straight"] = _train(engine, _forever(loader), 10)
        params.update({f"{name}/{k}": v for k, v in _params(engine).items()})
        engine.destroy()

        torch.manual_seed(100 + rank)
        engine, loader = _dropout_engine(stage, precision, seed=1)
        batches = _forever(loader)
        losses[f"{name}/first"] = _train(engine, batches, 4)
        engine.save_checkpoint(str(out / name))
        if (stage, precision) != CONFIGS[-1]:
            engine.destroy()
    _write(out, "train", rank, losses, params)
    assert engine is not None
    _train(engine, batches, 1)
    if rank == 1:
        commit.write_safetensors = _die_halfway
    engine.save_checkpoint(str(out / f"s{CONFIGS[-1][0]}_{CONFIGS[-1][1]}"))
    raise AssertionError("unreachable: the save above must fail on every rank")


def _resume_phase(out: Path, rank: int) -> tuple[dict, dict]:
    losses: dict[str, list[float]] = {}
    params: dict[str, torch.Tensor] = {}
    for stage, precision in CONFIGS:
        name = f"s{stage}_{precision}"
        engine, loader = _dropout_engine(stage, precision, seed=77)  # different init
        torch.manual_seed(4242)  # RNG must come from the checkpoint
        path, _ = load_checkpoint(engine, str(out / name), restore_rng=True)
        assert path is not None and path.endswith("global_step4"), path
        losses[f"{name}/rest"] = _train(engine, _forever(loader), 6)
        params.update({f"{name}/{k}": v for k, v in _params(engine).items()})
        engine.destroy()
    return losses, params


def _write(out: Path, phase: str, rank: int, losses: dict, params: dict) -> None:
    (out / f"{phase}_rank{rank}.json").write_text(json.dumps(losses))
    save_file({k: v.contiguous() for k, v in params.items()}, str(out / f"{phase}_rank{rank}.st"))


def main() -> None:
    phase, out = sys.argv[1], Path(sys.argv[2])
    shardspeed.init_distributed(dist_backend="gloo", timeout=PG_TIMEOUT)
    torch.set_num_threads(1)
    rank = comm.get_rank()
    if phase == "train":
        _train_phase(out, rank)
    else:
        _write(out, phase, rank, *_resume_phase(out, rank))
    comm.destroy_process_group()


if __name__ == "__main__":
    main()
