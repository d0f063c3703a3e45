"""Asynchronous checkpoint saves (world 2, stages 2 and 3, fp32).

* ``save_checkpoint(..., async_save=True)`` returns while the writer thread is held at a
  gate before writing (a synchronous save would wait for the gate's 30 s timeout);
  ``latest`` still names the previous tag; training continues at once and changes every
  parameter before the gate opens, yet the published checkpoint holds the values at save
  time, and a fresh engine loaded from it continues bitwise like the engine that saved it;
* the ``checkpoint.async_save`` config key (and DeepSpeed's ``checkpoint.writer.decoupled``)
  turns it on without the keyword;
* a failure in the background writer of one rank publishes nothing: ``latest`` keeps the
  previous tag, the error is raised on every rank by ``wait_checkpoint()`` or by the next
  ``save_checkpoint`` (which then saves nothing), and saving works again afterwards.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from parity_common import ParitySpec, make_model, micro_batch

from shardspeed.checkpoint import CheckpointError, load_checkpoint, save_checkpoint

GATE_TIMEOUT_S = 30.0


def _spec(stage: int) -> ParitySpec:
    return ParitySpec(stage=stage, world=2, gas=2, steps=6, bucket_size=1500)


def _engine(spec: ParitySpec, seed: int | None = None, checkpoint: dict | None = None):
    import shardspeed

    model = make_model(replace(spec, seed=seed) if seed is not None else spec)
    cfg = spec.config()
    if spec.stage == 3:
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 20
    if checkpoint is not None:
        cfg["checkpoint"] = checkpoint
    engine, _, _, _ = shardspeed.initialize(model=model, config=cfg)
    return engine


def _train(engine, spec: ParitySpec, steps: range) -> list[float]:
    from shardspeed import comm

    rank, world = comm.get_rank(), comm.get_world_size()
    losses = []
    for step in steps:
        for k in range(spec.gas):
            x, y = micro_batch(spec, step, k * world + rank)
            _, loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss))
    return losses


def _params(engine) -> dict[str, torch.Tensor]:
    state = engine.state_dict()  # gathers at stage 3
    return {n: state[n].detach().clone() for n, _ in engine.module.named_parameters()}


def _latest(d: Path) -> str:
    return (d / "latest").read_text()


class _GatedWriter:
    """Holds every rank-file write until :meth:`open` (or a 30 s timeout)."""

    def __enter__(self) -> _GatedWriter:
        from shardspeed.checkpoint import commit

        self._real = commit.write_safetensors
        self._gate = threading.Event()

        def gated(tensors, path, *args, **kwargs):
            self._gate.wait(GATE_TIMEOUT_S)
            return self._real(tensors, path, *args, **kwargs)

        commit.write_safetensors = gated
        return self

    def open(self) -> None:
        self._gate.set()

    def __exit__(self, *exc: object) -> None:
        from shardspeed.checkpoint import commit

        self._gate.set()
        commit.write_safetensors = self._real


def _async_rank(tmp: str, stage: int) -> dict:
    from shardspeed import comm

    spec, d = _spec(stage), Path(tmp) / f"s{stage}"
    engine = _engine(spec)
    _train(engine, spec, range(2))
    save_checkpoint(engine, d, tag="a")
    _train(engine, spec, range(2, 3))
    at_save = _params(engine)
    with _GatedWriter() as gate:
        started = time.monotonic()
        assert save_checkpoint(engine, d, tag="b", async_save=True) is True
        returned_after = time.monotonic() - started
        latest_on_return = _latest(d)
        after = _train(engine, spec, range(3, 4))  # changes every parameter meanwhile
        comm.barrier()  # every rank looked at `latest` before any writer may go on
        gate.open()
        after += _train(engine, spec, range(4, 5))  # training collectives during the commit
        engine.wait_checkpoint()
    assert _latest(d) == "b"
    changed = _params(engine)
    engine.destroy()

    # a fresh engine (other init; async by config) loads the values at save time
    fresh = _engine(spec, seed=99, checkpoint={"async_save": True})
    path, _ = load_checkpoint(fresh, d)
    assert path is not None and path.endswith("b"), path
    loaded = _params(fresh)
    resumed = _train(fresh, spec, range(3, 5))
    resumed_params = _params(fresh)
    with _GatedWriter() as gate:
        save_checkpoint(fresh, d, tag="c")  # async by config
        latest_after_config_save = _latest(d)
        comm.barrier()
        gate.open()
    fresh.destroy()  # waits for "c"
    assert _latest(d) == "c"

    # a writer failure on rank 1 only: nothing published, raised on every rank
    decoupled = _engine(spec, checkpoint={"writer": {"decoupled": True}})
    load_checkpoint(decoupled, d, tag="b")
    os.environ["SHARDSPEED_CKPT_FAULT"] = "after_rank_files:1"
    try:
        save_checkpoint(decoupled, d, tag="bad1")  # async via DeepSpeed's key
        with pytest.raises(CheckpointError, match=r"rank\(s\) \[1\] failed writing"):
            decoupled.wait_checkpoint()
        save_checkpoint(decoupled, d, tag="bad2", async_save=True)
        with pytest.raises(CheckpointError, match=r"bad2 was not saved"):
            save_checkpoint(decoupled, d, tag="never", async_save=True)  # surfaces bad2
    finally:
        del os.environ["SHARDSPEED_CKPT_FAULT"]
    latest_after_failures = _latest(d)
    save_checkpoint(decoupled, d, tag="good", async_save=True)
    decoupled.wait_checkpoint()
    decoupled.destroy()
    return {
        "returned_after": returned_after,
        "latest_on_return": latest_on_return,
        "latest_after_config_save": latest_after_config_save,
        "latest_after_failures": latest_after_failures,
        "at_save": at_save,
        "changed": changed,
        "loaded": loaded,
        "after": after,
        "resumed": resumed,
        "resumed_params": resumed_params,
        "tags": sorted(p.name for p in d.iterdir() if ".tmp-" not in p.name),
    }


def _all_stages(tmp: str) -> list[dict]:
    return [_async_rank(tmp, stage) for stage in (2, 3)]


def test_async_save_snapshot_commit_and_failure(tmp_path: Path) -> None:
    from shardspeed.testing import run_distributed

    per_rank = run_distributed(_all_stages, 2, str(tmp_path), timeout=300)
    for rank, results in enumerate(per_rank):
        for stage, r in zip((2, 3), results):
            label = f"rank {rank} stage {stage}"
            assert r["returned_after"] < GATE_TIMEOUT_S / 3, f"{label}: async save blocked"
            assert r["latest_on_return"] == "a", label
            assert r["latest_after_config_save"] == "b", f"{label}: config async_save ignored"
            assert r["latest_after_failures"] == "c", label
            script = "zero_to_fp32.py"  # written next to ZeRO checkpoints, as DeepSpeed
            assert r["tags"] == ["a", "b", "c", "good", "latest", script], (label, r["tags"])
            for name, value in r["at_save"].items():
                assert not torch.equal(value, r["changed"][name]), f"{label}: {name} unchanged"
                assert torch.equal(value, r["loaded"][name]), f"{label}: {name} not at save time"
                assert torch.equal(r["changed"][name], r["resumed_params"][name]), label
            assert r["after"] == r["resumed"], f"{label}: {r['after']} != {r['resumed']}"
    for stage in (2, 3):
        assert any(".tmp-" in p.name for p in (tmp_path / f"s{stage}").iterdir())
