"""ZeRO stage 3 behaviour beyond parity: memory, branches, reuse, GatheredParameters, errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint

from shardspeed.testing import run_distributed


class Stack(nn.Module):
    """Three linear layers in a ModuleList (3 units) and a head (root unit)."""

    def __init__(
        self,
        width: int = 16,
        skip: object = None,
        reuse: bool = False,
        ckpt: bool = False,
        skip_layer: int = 1,
    ) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(width, width) for _ in range(3)])
        self.head = nn.Linear(width, 1)
        self.skip = skip  # callable(step) -> bool: skip layer ``skip_layer`` on this forward
        self.skip_layer = skip_layer
        self.reuse = reuse  # run layer 0 twice
        self.ckpt = ckpt  # recompute the layers in backward (non-reentrant checkpoint)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = self.skip is not None and self.skip(self.calls)
        self.calls += 1
        for i, layer in enumerate(self.layers):
            if i == self.skip_layer and skip:
                continue
            if self.ckpt:
                x = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False).tanh()
            else:
                x = torch.tanh(layer(x))
            if i == 0 and self.reuse:
                x = torch.tanh(layer(x))
        return self.head(x).pow(2).mean()


def _config(**zero: object) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **zero},
    }


def _batch(step: int) -> torch.Tensor:
    return torch.randn(4, 16, generator=torch.Generator().manual_seed(100 + step))


def _train(model: nn.Module, steps: int, config: dict) -> dict[str, torch.Tensor]:
    import shardspeed
    from shardspeed.zero import GatheredParameters, ZeroParamStatus
    from shardspeed.zero.unit_sharding import UnitSharding

    engine, _, _, _ = shardspeed.initialize(model=model, config=config)
    assert isinstance(engine.sharding, UnitSharding)
    for step in range(steps):
        loss = engine(_batch(step))  # same batch on every rank: the mean gradient is its gradient
        engine.backward(loss)
        engine.step()
    for p in model.parameters():
        assert p.ds_status is ZeroParamStatus.NOT_AVAILABLE and p.numel() == 0, p.ds_shape
    with GatheredParameters(model.parameters()):
        out = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine.destroy()
    return out


def _reference(model: nn.Module, steps: int) -> dict[str, torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        model(_batch(step)).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _fresh(**kw: object) -> Stack:
    torch.manual_seed(0)
    return Stack(**kw)


def _consistent_cases() -> list:
    return [
        _train(_fresh(reuse=True), 3, _config()),  # a unit used twice in one forward
        _train(_fresh(skip=lambda c: c == 1), 3, _config()),  # skipped on every rank
        _train(_fresh(), 2, _config(stage3_prefetch_bucket_size=0)),  # no prefetch
        _train(_fresh(ckpt=True), 2, _config()),  # activation checkpointing
    ]


def test_reuse_and_consistent_skip_match_plain_training() -> None:
    results = run_distributed(_consistent_cases, 2, timeout=120)
    refs = [
        _reference(_fresh(reuse=True), 3),
        _reference(_fresh(skip=lambda c: c == 1), 3),
        _reference(_fresh(), 2),
        _reference(_fresh(), 2),
    ]
    for rank_results in results:
        for got, ref in zip(rank_results, refs):
            for name in ref:
                torch.testing.assert_close(got[name], ref[name], rtol=1e-5, atol=1e-6)


def _diverging_branch(layer: int) -> str:
    from shardspeed import comm
    from shardspeed.zero.order_check import ZeroOrderError

    rank = comm.get_rank()
    try:
        # the layer is skipped on rank 0 only, at the second step
        _train(_fresh(skip=lambda c: c == 1 and rank == 0, skip_layer=layer), 3, _config())
    except ZeroOrderError as err:
        return str(err)
    return "completed"


@pytest.mark.parametrize("layer", [0, 1, 2])
def test_rank_divergent_branch_raises_instead_of_hanging(layer: int) -> None:
    results = run_distributed(_diverging_branch, 2, layer, timeout=60)
    if results != ["completed", "completed"]:
        for msg in results:
            assert "ranks diverged" in msg and "same modules in the same order" in msg, msg


def _memory() -> dict:
    import shardspeed
    from shardspeed.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=64))
    n = sum(p.numel() for p in model.parameters())
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    engine, _, _, _ = shardspeed.initialize(model=model, config=config)
    x = torch.randint(0, 256, (2, 16))
    _, loss = engine(x, x)
    engine.backward(loss)
    engine.step()
    out = engine.memory_breakdown()
    out["n_params"] = n
    engine.destroy()
    return out


def test_memory_breakdown_bf16_adam_is_16_bytes_per_param_over_n() -> None:
    # bf16 shard (2) + bf16 grad shard (2, GAS 1) + fp32 master (4) + Adam m, v (8) = 16 P / N,
    # plus padding (< N elements per flat) and Adam's step counters.
    for mem in run_distributed(_memory, 4, timeout=120):
        p, world = mem["n_params"], 4
        states = mem["params"] + mem["grads"] + mem["master_params"] + mem["optimizer_state"]
        assert abs(states - 16 * p / world) <= 0.05 * 16 * p / world, (states, 16 * p / world)
        assert abs(mem["params"] - 2 * p / world) <= 0.05 * 2 * p / world, mem


def _gathered_modifier() -> list[float]:
    import shardspeed
    from shardspeed import comm
    from shardspeed.zero import GatheredParameters

    model = _fresh()
    engine, _, _, _ = shardspeed.initialize(model=model, config=_config())
    weight = model.layers[2].weight
    with GatheredParameters([weight], modifier_rank=0):
        if comm.get_rank() == 0:
            weight.data.fill_(0.5)
    with GatheredParameters(model.parameters()):
        seen = [float(weight.sum()), float(model.layers[0].weight.sum())]
    sd = engine.state_dict()
    seen.append(float(sd["layers.2.weight"].sum()))
    engine.destroy()
    return seen


def test_gathered_parameters_modifier_rank_broadcasts_and_updates_shards() -> None:
    ref = float(_fresh().layers[0].weight.detach().sum())
    for seen in run_distributed(_gathered_modifier, 2, timeout=60):
        assert seen[0] == pytest.approx(0.5 * 16 * 16)
        assert seen[1] == pytest.approx(ref, rel=1e-6)
        assert seen[2] == pytest.approx(0.5 * 16 * 16)


def _modified_offloaded(nvme_path: str) -> dict[str, torch.Tensor]:
    import shardspeed
    from shardspeed import comm
    from shardspeed.zero import GatheredParameters

    model = _fresh()
    offload = {
        "offload_param": {"device": "cpu"},  # the shard edit lands in a host tensor
        "offload_optimizer": {"device": "nvme", "nvme_path": nvme_path},  # the master in a file
    }
    engine, _, _, _ = shardspeed.initialize(model=model, config=_config(**offload))
    weight = model.layers[2].weight
    with GatheredParameters([weight], modifier_rank=0):
        if comm.get_rank() == 0:
            weight.data.fill_(0.5)
    for step in range(2):  # the step starts from the edited master, not the old one
        engine.backward(engine(_batch(step)))
        engine.step()
    with GatheredParameters(model.parameters()):
        out = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine.destroy()
    return out


def test_gathered_parameters_edit_reaches_offloaded_shards_and_nvme_masters(tmp_path) -> None:
    ref_model = _fresh()
    with torch.no_grad():
        ref_model.layers[2].weight.fill_(0.5)
    ref = _reference(ref_model, 2)
    for got in run_distributed(_modified_offloaded, 2, str(tmp_path), timeout=60):
        for name in ref:
            torch.testing.assert_close(got[name], ref[name], rtol=1e-5, atol=1e-6)


def _sequential_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))


def _sequential(train: bool) -> torch.Tensor:
    import shardspeed
    from shardspeed.zero import GatheredParameters

    model = _sequential_model()
    engine, _, _, _ = shardspeed.initialize(model=model, config=_config())
    assert [u.name for u in engine.sharding.units] == ["<root>", "0", "2"]  # root has no params
    for step in range(2):
        loss = engine(_batch(step)).pow(2).mean()
        engine.backward(loss)
        engine.step()
    with GatheredParameters(model.parameters()):
        out = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
    engine.destroy()
    return out


def test_sequential_model_children_are_units() -> None:
    model = _sequential_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        model(_batch(step)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    ref = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    for got in run_distributed(_sequential, 2, True, timeout=60):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
