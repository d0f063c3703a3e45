"""Shared by the DeepSpeed-layout checkpoint tests: the run, its config and training loop.

The parity GPT (tiny, tied embedding/head) trains with AdamW and WarmupLR on 2 ranks; the
same config drives ShardSpeed and, in the oracle test, real DeepSpeed 0.19.8.
"""

from __future__ import annotations

from typing import Any

import torch
from parity_common import ParitySpec, make_model, micro_batch

SAVED_STEPS, MORE_STEPS = 3, 3
SCHEDULER = {
    "type": "WarmupLR",
    "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 5},
}


def config(stage: int, precision: str = "fp32", *, torch_adam: bool = False) -> dict[str, Any]:
    params: dict[str, Any] = {"lr": 1e-2, "weight_decay": 0.01}
    if torch_adam:
        params["torch_adam"] = True
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": params},
        "scheduler": SCHEDULER,
    }
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def spec(precision: str = "fp32") -> ParitySpec:
    return ParitySpec(world=2, precision=precision)


def train(engine: Any, steps: range, rank: int, precision: str = "fp32") -> list[float]:
    """One micro-batch per step (GAS 1); the batch depends on the step and the rank only."""
    losses = []
    for step in steps:
        x, y = micro_batch(spec(precision), step, rank)
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.item()))
    return losses


def shardspeed_save_and_continue(save_dir: str, stage: int, precision: str) -> dict:
    """One ShardSpeed rank: train, save in DeepSpeed's layout, train on (uninterrupted)."""
    import shardspeed

    rank = torch.distributed.get_rank()
    model = make_model(spec(precision))
    cfg = {**config(stage, precision), "checkpoint": {"layout": "deepspeed"}}
    engine, *_ = shardspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    saved = train(engine, range(SAVED_STEPS), rank, precision)
    engine.save_checkpoint(save_dir, client_state={"epoch": 3})
    weights = {
        n: shardspeed.utils.safe_get_full_fp32_param(p).clone()
        for n, p in engine.module.named_parameters()
    }
    more = train(engine, range(SAVED_STEPS, SAVED_STEPS + MORE_STEPS), rank, precision)
    return {"saved": saved, "more": more, "weights": weights}


def tiny_model() -> torch.nn.Module:
    """A few-hundred-byte MLP, for the universal checkpoint golden."""
    torch.manual_seed(7)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def tiny_batch(step: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 101 + index)
    return torch.randn(2, 4, generator=g), torch.randint(0, 3, (2,), generator=g)


def tiny_train(engine: Any, steps: range, rank: int, gas: int = 1) -> list[float]:
    """Micro-batch ``rank * gas + m`` of each step: world 2 x GAS 1 == world 1 x GAS 2."""
    losses = []
    for step in steps:
        for micro in range(gas):
            x, y = tiny_batch(step, rank * gas + micro)
            loss = torch.nn.functional.cross_entropy(engine(x), y)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.item()))
    return losses
