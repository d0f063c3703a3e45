"""The B/W split of zero-bubble pipelines: deferred Linear weight gradients (one process).

A small model of Linear + LayerNorm + GELU layers (plus Linear subclasses: one whose
``forward`` calls ``super().forward``, one that bypasses ``F.linear``, one without bias)
runs forward, B (input gradients, weight gradients deferred) and W (weight gradients).
The gradients must equal a plain backward's, hooks must fire once per parameter per W,
and the stash must be empty afterwards. Also: several micro-batches in flight, activation
checkpointing (reentrant and not), accumulation into an existing ``.grad`` view, and
bitwise-plain results when the split is not active.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint

from shardspeed.parallel.pipeline.instructions import OptimizerStep, ReduceGrads, ReduceTiedGrads
from shardspeed.parallel.pipeline.p2p import StageLink
from shardspeed.parallel.pipeline.schedule import build_schedule
from shardspeed.parallel.pipeline.weight_grad import WeightGradSplit
from shardspeed.pipe import LayerSpec, PipelineModule
from shardspeed.runtime.activation_checkpointing.checkpoint import checkpoint
from shardspeed.runtime.pipe.executor import ScheduleExecutor
from shardspeed.topology import Topology

WIDTH = 8


class ScaledLinear(nn.Linear):
    """Overrides ``forward`` and reaches ``F.linear`` through ``super().forward``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 0.5 * super().forward(x)


class MatmulLinear(nn.Linear):
    """Bypasses ``F.linear``: its weight gets its gradient in B, not deferred."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.t() + self.bias


class Block(nn.Module):
    """(B, T, W) -> (B, T, W): LayerNorm, Linear up, GELU, Linear down, residual."""

    def __init__(self, width: int, down: type[nn.Linear] = nn.Linear) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = down(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


def make_model(checkpointing: str | None = None) -> nn.Module:
    torch.manual_seed(0)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(
                [Block(WIDTH), Block(WIDTH, ScaledLinear), Block(WIDTH, MatmulLinear)]
            )
            self.head = nn.Linear(WIDTH, WIDTH, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                if checkpointing == "reentrant":
                    x = checkpoint(block, x)
                elif checkpointing == "non-reentrant":
                    x = torch_checkpoint.checkpoint(block, x, use_reentrant=False)
                else:
                    x = block(x)
            return self.head(x)

    return Model()


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, WIDTH, generator=g)  # (B, T, W)
    return x.requires_grad_(True), torch.randn(2, 3, WIDTH, generator=g)


def plain_grads(model: nn.Module, seeds: list[int]) -> dict[str, torch.Tensor]:
    """Parameter gradients of a plain backward over ``seeds`` (and ``"input"``: the last
    micro-batch's input gradient)."""
    for seed in seeds:
        x, target = batch(seed)
        F.mse_loss(model(x), target).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    grads["input"] = x.grad
    model.zero_grad(set_to_none=True)
    return grads


def deferred_linear_params(model: nn.Module) -> set[str]:
    """Parameters whose gradient W computes: Linear layers that go through F.linear."""
    return {
        f"{name}.{pname}"
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and not isinstance(module, MatmulLinear)
        for pname, _ in module.named_parameters(recurse=False)
    }


def hook_counter(model: nn.Module) -> Counter:
    fired: Counter = Counter()
    for name, param in model.named_parameters():
        param.register_post_accumulate_grad_hook(lambda p, name=name: fired.update([name]))
    return fired


@pytest.mark.parametrize("checkpointing", [None, "reentrant", "non-reentrant"])
def test_deferred_weight_grads_match_plain_backward(checkpointing: str | None) -> None:
    model = make_model(checkpointing)
    expected = plain_grads(model, [1])
    deferred = deferred_linear_params(model)
    fired = hook_counter(model)
    split = WeightGradSplit(model)
    x, target = batch(1)
    with split.active():
        loss = F.mse_loss(model(x), target)
        with split.deferring("mb0"):  # B
            loss.backward()
        assert split.pending() == ["mb0"] and split.stashed_bytes() > 0
        torch.testing.assert_close(x.grad, expected.pop("input"), rtol=0, atol=1e-6)
        for name, param in model.named_parameters():
            if name in deferred:
                assert param.grad is None, name
            else:  # LayerNorm, MatmulLinear: their gradients arrive in B
                torch.testing.assert_close(param.grad, expected[name], rtol=0, atol=1e-6)
        assert set(fired) == set(expected) - deferred and all(v == 1 for v in fired.values())
        fired.clear()
        split.apply("mb0")  # W
    assert split.pending() == [] and split.stashed_bytes() == 0
    assert set(fired) == deferred and all(v == 1 for v in fired.values())
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, expected[name], rtol=0, atol=1e-6, msg=name)


def test_micro_batches_in_flight_accumulate_like_plain_backward() -> None:
    """F0 F1 B0 B1 W1 W0 (W in any order) sums to the plain gradient of both."""
    model = make_model()
    expected = plain_grads(model, [1, 2])
    del expected["input"]
    split = WeightGradSplit(model)
    with split.active():
        losses = {}
        for mb in (0, 1):
            x, target = batch(mb + 1)
            losses[mb] = F.mse_loss(model(x), target)
        for mb in (0, 1):
            with split.deferring(mb):
                losses[mb].backward()
        split.apply(1)
        split.apply(0)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, expected[name], rtol=0, atol=1e-6, msg=name)


def test_w_accumulates_into_an_existing_grad_view() -> None:
    """The engine's flat buffer: ``.grad`` is a view; W adds into it in place."""
    model = make_model()
    expected = plain_grads(model, [1])
    head = model.head.weight
    flat = torch.full((head.numel(),), 0.25)
    head.grad = flat.view_as(head)
    split = WeightGradSplit(model)
    x, target = batch(1)
    with split.active():
        with split.deferring(0):
            F.mse_loss(model(x), target).backward()
        split.apply(0)
    assert head.grad.data_ptr() == flat.data_ptr()
    torch.testing.assert_close(flat.view_as(head), expected["head.weight"] + 0.25)


def test_fused_backward_under_an_active_split() -> None:
    """A BackwardPass in a split schedule: no deferring, weight gradients at once."""
    model = make_model()
    expected = plain_grads(model, [3])
    del expected["input"]
    split = WeightGradSplit(model)
    x, target = batch(3)
    with split.active():
        F.mse_loss(model(x), target).backward()
    assert split.pending() == []
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, expected[name], rtol=0, atol=1e-6, msg=name)


def test_inactive_or_no_grad_is_bitwise_plain() -> None:
    model = make_model()
    expected = plain_grads(model, [4])
    del expected["input"]
    split = WeightGradSplit(model)
    with split.active():
        pass  # installing and removing leaves the layers untouched
    assert all("forward" not in m.__dict__ for m in model.modules())
    x, target = batch(4)
    F.mse_loss(model(x), target).backward()
    for name, param in model.named_parameters():
        assert torch.equal(param.grad, expected[name]), name
    x, _ = batch(5)
    plain = model(x.detach())
    with split.active(), torch.no_grad():
        assert torch.equal(model(x.detach()), plain)


def test_errors_name_the_problem() -> None:
    model = make_model()
    split = WeightGradSplit(model)
    with pytest.raises(RuntimeError, match="without a matching input-gradient pass"):
        split.apply("never")
    with split.active(), pytest.raises(RuntimeError, match="not reentrant"):
        with split.active():
            pass
    model.head.weight.ds_shape = model.head.weight.shape  # a ZeRO-3 partitioned parameter
    with pytest.raises(ValueError, match="ZeRO-3"):
        WeightGradSplit(model)


def test_input_without_grad_still_defers() -> None:
    """The first stage's data needs no gradient; the Linear weights still do."""
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH))
    x, target = batch(6)
    x = x.detach()
    F.mse_loss(model(x), target).backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    split = WeightGradSplit(model)
    with split.active():
        out = model(x)
        assert out.requires_grad
        with split.deferring(0):
            F.mse_loss(out, target).backward()
        assert all(p.grad is None for p in model.parameters())
        split.apply(0)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, expected[name], rtol=0, atol=1e-6, msg=name)


# ---------------------------------------------------------------------------- executor
def seeded_blocks(num_layers: int) -> nn.Sequential:
    """The blocks ``PipelineModule(seed_layers=True)`` builds, named alike ("0.norm.weight")."""
    blocks = []
    for i in range(num_layers):
        torch.manual_seed(1234 + i)
        blocks.append(Block(WIDTH))
    return nn.Sequential(*blocks)


@pytest.mark.parametrize(
    ("kind", "m", "interval"),
    [("zb-h1", 3, 0), ("zbv", 3, 0), ("zbv", 2, 1), ("dualpipev", 2, 0), ("1f1b", 3, 0)],
)
def test_executor_runs_split_schedules_on_one_stage(kind: str, m: int, interval: int) -> None:
    """p=1: the V's turn is local both ways; gradients match a plain backward (also with
    activation checkpointing every layer); every Linear parameter's grad-ready hook fires
    once per micro-batch; timing is recorded."""
    data = [batch(10 + i) for i in range(m)]
    reference = seeded_blocks(4)
    for x, target in data:
        (F.mse_loss(reference(x.detach()), target) / m).backward()
    expected = {n: p.grad for n, p in reference.named_parameters()}

    module = PipelineModule([LayerSpec(Block, WIDTH) for _ in range(4)],
                            topology=Topology(1, pp=1, rank=0), loss_fn=F.mse_loss,
                            seed_layers=True, partition_method="uniform", schedule=kind,
                            activation_checkpoint_interval=interval)  # fmt: skip
    fired = hook_counter(module)
    cpu = torch.device("cpu")
    executor = ScheduleExecutor(module, StageLink([0], cpu), device=cpu,
                                input_dtype=torch.float32, scale_loss=lambda loss: loss / m)  # fmt: skip
    schedule = build_schedule(kind, m, 1, 0, module.virtual_stages)
    ends = {cls: lambda: None for cls in (ReduceTiedGrads, ReduceGrads, OptimizerStep)}
    result = executor.run(schedule, iter([(x.detach(), t) for x, t in data]), handlers=ends)
    assert len(result.losses) == m
    for name, param in module.named_parameters():
        torch.testing.assert_close(param.grad, expected[name], rtol=1e-6, atol=1e-7, msg=name)
    linear = {n for n, _ in module.named_parameters() if ".up." in n or ".down." in n}
    assert {n for n in linear if fired[n] != m} == set()  # once per micro-batch (its W)
    timing = executor.last_timing
    assert 0 < timing.busy <= timing.wall_s and 0 <= timing.bubble < 1
    assert ("W" in timing.busy_s) == (kind != "1f1b")
    assert executor.weight_split is None or executor.weight_split.pending() == []
