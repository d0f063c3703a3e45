"""``engine.load_state_dict`` must reach the optimizer's masters: after loading, the next
step starts from the loaded weights at every stage, with 16-bit parameters and offload
(stages 0-2 once left the fp32 masters stale, so the step silently undid the load)."""

from __future__ import annotations

import pytest
import torch

import shardspeed
from shardspeed.models import GPT, GPTConfig
from shardspeed.testing import run_distributed

CASES = [
    (0, "bf16", None),
    (1, "bf16", None),
    (2, "bf16", None),
    (2, "bf16", "cpu"),
    (3, "bf16", None),
    (1, "fp32", None),
    (2, "fp32", "cpu"),
]


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16))


def _batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(5 + i))
    return t[:, :-1], t[:, 1:]


def _train(stage: int, dtype: str, offload: str | None, load: bool) -> dict[str, torch.Tensor]:
    zero: dict = {"stage": stage}
    if offload:
        zero["offload_optimizer"] = {"device": offload}
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},  # stateless: only masters matter
        "zero_optimization": zero,
    }
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    engine, *_ = shardspeed.initialize(model=_model(), config=config)
    initial = {k: v.clone() for k, v in engine.state_dict().items()}
    if load:  # move away from the initial weights, then load them back
        for i in range(2):
            x, y = _batch(10 + i)
            engine.backward(engine(x, y)[1])
            engine.step()
        engine.load_state_dict(initial)
    x, y = _batch(0)
    engine.backward(engine(x, y)[1])
    engine.step()
    return {k: v.float() for k, v in engine.state_dict().items()}


def _compare() -> list[float]:
    out = []
    for stage, dtype, offload in CASES:
        fresh = _train(stage, dtype, offload, load=False)
        loaded = _train(stage, dtype, offload, load=True)
        out.append(max((fresh[k] - loaded[k]).abs().max().item() for k in fresh))
    return out


def test_load_state_dict_reaches_masters() -> None:
    diffs = run_distributed(_compare, 2)[0]
    for (stage, dtype, offload), diff in zip(CASES, diffs):
        assert diff == pytest.approx(0.0, abs=0.0), (stage, dtype, offload, diff)
