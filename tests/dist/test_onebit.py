"""1-bit optimizers on 2 gloo ranks through ``shardspeed.initialize`` (ZeRO stage 0).

* the compressed all-reduce: the same result on every rank, close to the true mean, error
  feedback makes repeated averages converge to it, and it moves <= 1/8 of the bytes of an
  fp32 all-reduce (counted by the comms logger);
* OneBitAdam: the ``freeze_step`` warm-up steps equal the one-process AdamW reference on the
  global batch; every compressed step moves <= 1/8 of plain Adam's bytes; parameters stay
  identical on both ranks;
* exact resume in the compression stage for OneBitAdam, ZeroOneAdam (inside a local-step
  interval) and OneBitLamb: save, continue, load into a fresh engine, continue -> identical
  losses and parameters. The per-rank error buffers (``rank_local_state()``) travel in each
  rank's checkpoint file.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from parity_common import ParitySpec, make_model, micro_batch, reference_run

from shardspeed.testing import run_distributed

SPEC = ParitySpec(steps=5, lr=1e-2, weight_decay=0.01, bucket_size=2000)


def _config(optimizer: str, params: dict[str, Any]) -> dict[str, Any]:
    cfg = SPEC.config()
    cfg["optimizer"] = {"type": optimizer, "params": {"lr": SPEC.lr, **params}}
    return cfg


def _engine(optimizer: str, params: dict[str, Any], seed: int = SPEC.seed):
    import shardspeed

    model = make_model(replace(SPEC, seed=seed))
    engine, _, _, _ = shardspeed.initialize(model=model, config=_config(optimizer, params))
    return engine


def _train(engine, steps: range) -> list[float]:
    from shardspeed import comm

    rank, world = comm.get_rank(), comm.get_world_size()
    losses = []
    for step in steps:
        x, y = micro_batch(SPEC, step, rank)
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        total = loss.detach().double().clone()
        comm.all_reduce(total)
        losses.append(float(total) / world)
    return losses


def _params(engine) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def _step_bytes(engine, step: int) -> int:
    """Bytes of every logged collective during one training step."""
    from shardspeed import comm

    comm.configure(enabled=True, prof_all=True)
    comm.reset_log()
    x, y = micro_batch(SPEC, step, comm.get_rank())
    _, loss = engine(x, y)
    engine.backward(loss)
    engine.step()
    ops = comm.get_logged_comm_ops()
    comm.configure(enabled=False)
    comm.reset_log()
    return sum(op["total_bytes"] for op in ops.values())


# -- the compressed all-reduce -------------------------------------------------------------


def _allreduce_rank() -> dict[str, Any]:
    from shardspeed import comm
    from shardspeed.optim.onebit import CompressedAllReduce

    rank, world = comm.get_rank(), comm.get_world_size()
    numel = 10_001
    base = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    x = base + 0.5 * torch.randn(numel, generator=torch.Generator().manual_seed(1 + rank))
    true_mean = x.clone()
    comm.all_reduce(true_mean)
    true_mean /= world

    reduce = CompressedAllReduce(None, world, rank)
    errors = reduce.new_errors(numel, x.device)
    comm.configure(enabled=True, prof_all=True)
    comm.reset_log()
    first = reduce(x, errors)
    compressed_bytes = sum(op["total_bytes"] for op in comm.get_logged_comm_ops().values())
    comm.reset_log()
    fp32 = x.clone()
    comm.all_reduce(fp32)
    fp32_bytes = sum(op["total_bytes"] for op in comm.get_logged_comm_ops().values())
    comm.configure(enabled=False)

    running = first.clone()
    for _ in range(99):  # error feedback: the average of repeated results -> the true mean
        running += reduce(x, errors)
    return {
        "first": first,
        "mean_of_100": running / 100,
        "true_mean": true_mean,
        "compressed_bytes": compressed_bytes,
        "fp32_bytes": fp32_bytes,
    }


def test_compressed_allreduce() -> None:
    r0, r1 = run_distributed(_allreduce_rank, 2)
    assert torch.equal(r0["first"], r1["first"])  # every rank decompresses the same bytes
    true = r0["true_mean"]
    cos = torch.nn.functional.cosine_similarity(r0["first"], true, dim=0)
    assert cos > 0.5, cos
    rel = (r0["mean_of_100"] - true).norm() / true.norm()
    assert rel < 0.05, rel
    assert r0["compressed_bytes"] * 8 <= r0["fp32_bytes"], (
        r0["compressed_bytes"],
        r0["fp32_bytes"],
    )


# -- OneBitAdam: warm-up parity and bytes -----------------------------------------------------


def _onebit_adam_rank() -> dict[str, Any]:
    from shardspeed import comm

    engine = _engine("OneBitAdam", {"freeze_step": 5, "weight_decay": SPEC.weight_decay})
    warmup = _train(engine, range(5))
    warm_params = {n: p.float() for n, p in _params(engine).items()}
    onebit_bytes = [_step_bytes(engine, s) for s in (5, 6)]
    _train(engine, range(7, 10))
    params = _params(engine)
    engine.destroy()

    adam = _engine("AdamW", {"weight_decay": SPEC.weight_decay})
    adam_bytes = _step_bytes(adam, 0)
    adam.destroy()
    gathered = [None] * comm.get_world_size()
    comm.all_gather_object(gathered, {n: p for n, p in params.items()})
    return {
        "warmup": warmup,
        "warm_params": warm_params,
        "onebit_bytes": onebit_bytes,
        "adam_bytes": adam_bytes,
        "params_by_rank": gathered,
    }


def test_onebit_adam_warmup_parity_and_bytes() -> None:
    ref_losses, ref_params = reference_run(SPEC)  # AdamW on the global batch, one process
    results = run_distributed(_onebit_adam_rank, 2)
    r0 = results[0]
    torch.testing.assert_close(r0["warmup"], ref_losses, rtol=1e-5, atol=1e-6)
    for name, p in ref_params.items():
        torch.testing.assert_close(r0["warm_params"][name], p, rtol=1e-5, atol=1e-6)
    for step_bytes in r0["onebit_bytes"]:
        assert 0 < step_bytes * 8 <= r0["adam_bytes"], (step_bytes, r0["adam_bytes"])
    p0, p1 = r0["params_by_rank"]
    for name in p0:  # the compressed momentum is the same on both ranks, so are the params
        assert torch.equal(p0[name], p1[name]), name


# -- exact resume in the compression stage ----------------------------------------------------

RESUME_CASES = {
    "OneBitAdam": {"freeze_step": 3},
    "ZeroOneAdam": {
        "var_freeze_step": 6,
        "var_update_scaler": 2,
        "local_step_scaler": 2,
        "local_step_clipper": 4,
    },
    "OneBitLamb": {"freeze_step": 3, "weight_decay": 0.01},
}


def _resume_rank(tmp: str, optimizer: str, save_at: int, more: int) -> dict[str, Any]:
    from shardspeed.checkpoint import load_checkpoint, save_checkpoint

    params = RESUME_CASES[optimizer]
    engine = _engine(optimizer, params)
    first = _train(engine, range(save_at))
    ckpt = Path(tmp) / optimizer
    local = {k: v.clone() for k, v in engine.basic_optimizer.rank_local_state().items()}
    save_checkpoint(engine, ckpt)  # the rank files carry each rank's error feedback
    straight = _train(engine, range(save_at, save_at + more))
    straight_params = _params(engine)
    engine.destroy()

    engine = _engine(optimizer, params, seed=99)  # different initial weights
    load_checkpoint(engine, ckpt)
    resumed = _train(engine, range(save_at, save_at + more))
    resumed_params = _params(engine)
    step_bytes = _step_bytes(engine, save_at + more)  # one more compression-stage step
    fp32_bytes = 4 * sum(m.numel() for g in engine.flat_groups for m in g.masters)
    engine.destroy()
    return {
        "first": first,
        "straight": straight,
        "resumed": resumed,
        "straight_params": straight_params,
        "resumed_params": resumed_params,
        "num_local": len(local),
        "step_bytes": step_bytes,
        "fp32_bytes": fp32_bytes,  # what plain Adam all-reduces per step
    }


def _check_resume(results: list[dict[str, Any]], optimizer: str) -> None:
    for rank, r in enumerate(results):
        assert r["num_local"] > 0, f"{optimizer}: no rank-local state saved"
        assert r["step_bytes"] * 8 <= r["fp32_bytes"], (optimizer, r["step_bytes"])
        assert r["straight"] == r["resumed"], f"{optimizer} rank {rank}: {r}"
        for name, p in r["straight_params"].items():
            assert torch.equal(p, r["resumed_params"][name]), f"{optimizer} rank {rank}: {name}"


def test_onebit_adam_exact_resume(tmp_path: Path) -> None:
    _check_resume(run_distributed(_resume_rank, 2, str(tmp_path), "OneBitAdam", 5, 4), "OneBitAdam")


def test_zero_one_adam_exact_resume_inside_local_interval(tmp_path: Path) -> None:
    # variance phase: full precision at steps 1, 2, 4, 1-bit gradients at 3, 5, 6; local
    # phase from step 7, synchronising at 7, 8, 10, 12, 16: saved after step 13
    results = run_distributed(_resume_rank, 2, str(tmp_path), "ZeroOneAdam", 13, 4)
    _check_resume(results, "ZeroOneAdam")


def test_onebit_lamb_exact_resume(tmp_path: Path) -> None:
    results = run_distributed(_resume_rank, 2, str(tmp_path), "OneBitLamb", 5, 3)
    _check_resume(results, "OneBitLamb")


# -- 16-bit training ---------------------------------------------------------------------------


def _half_precision_rank(precision: str) -> dict[str, Any]:
    import shardspeed
    from shardspeed import comm

    spec = replace(SPEC, precision=precision)
    cfg = spec.config()
    cfg["optimizer"] = {"type": "OneBitAdam", "params": {"lr": SPEC.lr, "freeze_step": 3}}
    engine, _, _, _ = shardspeed.initialize(model=make_model(spec), config=cfg)
    losses = _train(engine, range(8))
    params = {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
    engine.destroy()
    gathered = [None] * comm.get_world_size()
    comm.all_gather_object(gathered, params)
    return {"losses": losses, "params_by_rank": gathered}


def test_onebit_adam_bf16_and_fp16() -> None:
    for precision in ("bf16", "fp16"):
        r0 = run_distributed(_half_precision_rank, 2, precision)[0]
        assert all(torch.isfinite(torch.tensor(r0["losses"]))), (precision, r0["losses"])
        p0, p1 = r0["params_by_rank"]
        for name in p0:
            assert torch.equal(p0[name], p1[name]), (precision, name)
