"""ZeRO-2 and ZeRO-3 under pipeline parallelism (DeepSpeed refuses both).

Parity with the one-process reference of ``test_pipe_engine`` (fp32, 1e-5 relative on the
loss of every step and every final parameter, gradient clipping active so the norm spans
stages): pp 2 x dp 2 at ZeRO 2 and 3 for GPipe, 1F1B and interleaved 1F1B, GAS 4 and 8,
the tied embedding/head across the first and last stage, and both ZeRO-3 residencies
(``pipeline.reshard_after_forward``).

What the pipeline promises beyond equal numbers, measured on a wider model:

* gradients are reduced once per batch: one reduction per gradient bucket (ZeRO-2) or per
  unit flat (ZeRO-3), whatever the number of micro-batches;
* ZeRO-3 with the stage kept gathered issues one all-gather per unit per batch;
* per-rank model-state memory (``memory_breakdown()``) at ZeRO-3 against ZeRO-1;
* a checkpoint saved at pp 2 x dp 2 ZeRO-3 loads at pp 1 x dp 2 ZeRO-2 and continues like
  the reference.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from test_checkpoint_pipeline import _engine, _train
from test_pipe_engine import PipeSpec, _run_all, check_parity, reference_run

from shardspeed.testing import assert_close_rel, run_distributed

RESHARD = {"pipeline": {"reshard_after_forward": True}}


def test_pipeline_parity_zero2_zero3() -> None:
    specs = []
    for zero in (2, 3):
        specs += [
            PipeSpec(pp=2, dp=2, m=4, zero=zero),
            PipeSpec(pp=2, dp=2, m=8, zero=zero),
            PipeSpec(pp=2, dp=2, m=4, zero=zero, schedule="gpipe"),
            PipeSpec(pp=2, dp=2, m=4, zero=zero, schedule="interleaved", virtual=2),
            PipeSpec(pp=2, dp=2, m=4, zero=zero, tied=True),
        ]
    specs.append(PipeSpec(pp=2, dp=2, m=4, zero=3, tied=True, extra=RESHARD))
    check_parity(specs, run_distributed(_run_all, 4, specs, timeout=600))


def test_pipeline_parity_zero_bubble_zero2_zero3() -> None:
    """ZB-H1, ZBV and DualPipeV (weight gradients deferred to W passes) at ZeRO 2 and 3:
    the deferred gradients land in ``param.grad`` before the batch's one reduction; at
    ZeRO-3 the stage stays gathered until the last W."""
    specs = [
        PipeSpec(pp=2, dp=2, m=m, zero=zero, schedule=kind, virtual=1 if kind == "zb-h1" else 2)
        for zero in (2, 3)
        for kind in ("zb-h1", "zbv", "dualpipev")
        for m in (4, 8)
    ]
    specs += [
        PipeSpec(pp=2, dp=2, m=4, zero=z, schedule="zbv", virtual=2, tied=True) for z in (2, 3)
    ]
    check_parity(specs, run_distributed(_run_all, 4, specs, timeout=600))


def _reshard_zero_bubble() -> str:
    spec = PipeSpec(pp=2, m=4, zero=3, schedule="zb-h1", extra=RESHARD)
    try:
        _run_all([spec])
    except ValueError as err:
        return str(err)
    return "no error"


def test_zero_bubble_refuses_zero3_resharded_per_pass() -> None:
    message = run_distributed(_reshard_zero_bubble, 2)[0]
    assert "pipeline.reshard_after_forward" in message and "zb-h1" in message, message


# ---------------------------------------------------------------------------- what it costs
WIDE, WIDE_LAYERS = 64, 8


class Wide(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDE, WIDE)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))  # (B, T, WIDE)


def _tags_since(start: int) -> list[tuple[str, str]]:
    """(op, tag) of the collectives issued since ring-buffer sequence number ``start``,
    without ZeRO-3's two-element order checks."""
    from shardspeed.comm.logger import recent_entries

    return [(e[1], e[5] or "") for e in recent_entries() if e[0] > start and e[3] > 2]


def _costs(zero: int, m: int, extra: dict[str, Any], dp: int = 2) -> dict[str, Any]:
    import shardspeed
    from shardspeed.comm.logger import recent_entries
    from shardspeed.pipe import LayerSpec, PipeDataParallelTopology, PipelineModule

    net = PipelineModule(
        [LayerSpec(Wide) for _ in range(WIDE_LAYERS)],
        topology=PipeDataParallelTopology(num_pp=2, num_dp=dp),
        loss_fn=F.mse_loss,
        seed_layers=True,
        partition_method="uniform",
    )
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": m,
        "zero_optimization": {"stage": zero, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        **extra,
    }
    engine, _, _, _ = shardspeed.initialize(model=net, config=config)
    from shardspeed.utils import groups  # DeepSpeed's groups answer from the pipeline mesh

    assert groups.get_data_parallel_world_size() == dp  # the pipe axis is not data
    g = torch.Generator().manual_seed(engine.dp_rank)
    data = [(torch.randn(2, 4, WIDE, generator=g), torch.randn(2, 4, WIDE, generator=g))] * m
    engine.train_batch(iter(data))  # optimizer state exists after the first step
    start = max((e[0] for e in recent_entries()), default=-1)
    engine.train_batch(iter(data))
    issued = _tags_since(start)
    out = {
        "memory": engine.memory_breakdown(),
        "reductions": sum(1 for _, tag in issued if ".reduce_grads" in tag),
        "gathers": sum(1 for op, tag in issued if tag.startswith("zero3.") and "all_gather" in op),
        "buckets": len(engine.reducer.order),
    }
    engine.destroy()
    return out


def _all_costs() -> list[dict[str, Any]]:
    return [
        _costs(1, 4, {}),
        _costs(2, 4, {}),
        _costs(2, 8, {}),
        _costs(3, 4, {}),
        _costs(3, 8, {}),
        _costs(3, 4, RESHARD),
    ]


def test_pipeline_zero_reduces_once_per_batch_and_saves_memory() -> None:
    per_rank = run_distributed(_all_costs, 4, timeout=600)
    for rank, (z1, z2, z2_m8, z3, z3_m8, z3_reshard) in enumerate(per_rank):
        # one reduction per bucket (ZeRO-2) / unit flat (ZeRO-3) per batch, for any m
        assert z2["reductions"] == z2["buckets"] == z2_m8["reductions"], (rank, z2, z2_m8)
        assert z3["reductions"] == z3["buckets"] == z3_m8["reductions"], (rank, z3, z3_m8)
        # the stage gathered once per batch: one all-gather per unit (4 layers + root)
        assert z3["gathers"] == z3_m8["gathers"] == z3["buckets"], (rank, z3, z3_m8)
        assert z3_reshard["gathers"] > z3["gathers"], (rank, z3_reshard, z3)
        # model states (fp32 AdamW: 4 + 4 + 8 bytes per parameter): ZeRO-1 keeps params and
        # grads whole, ZeRO-3 keeps 1/dp of everything: (16 / 2) / (8 + 8 / 2) = 2/3 at dp 2
        ratio = z3["memory"]["total"] / z1["memory"]["total"]
        assert ratio <= 2 / 3 + 0.01, (rank, ratio, z1["memory"], z3["memory"])
        assert z2["memory"]["grads"] < z1["memory"]["grads"], (rank, z2, z1)


def _memory_dp4() -> list[dict[str, Any]]:
    return [_costs(1, 4, {}, dp=4)["memory"], _costs(3, 4, {}, dp=4)["memory"]]


@pytest.mark.slow
def test_pipeline_zero3_memory_at_dp4() -> None:
    """pp 2 x dp 4 (8 ranks): ZeRO-3 keeps 16/4 = 4 bytes of model state per parameter
    where ZeRO-1 keeps 8 + 8/4 = 10 (fp32 AdamW), 0.4x; at dp 2 the floor is 2/3."""
    per_rank = run_distributed(_memory_dp4, 8, timeout=900)
    for rank, (z1, z3) in enumerate(per_rank):
        ratio = z3["total"] / z1["total"]
        assert ratio <= 0.55, (rank, ratio, z1, z3)
        assert ratio >= 0.4 - 0.01, (rank, ratio, z1, z3)  # nothing is left uncounted


# ---------------------------------------------------------------------------- checkpoints
def _save(spec: PipeSpec, path: str) -> list[float]:
    engine = _engine(spec)
    losses = _train(engine, spec, range(2))
    engine.save_checkpoint(path)
    engine.destroy()
    return losses


def _load(spec: PipeSpec, path: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    engine = _engine(spec, base_seed=4321)  # other layer seeds: all comes from the file
    loaded, _ = engine.load_checkpoint(path)
    assert loaded is not None and engine.global_steps == 2
    losses = _train(engine, spec, range(2, 4))
    params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    engine.destroy()
    return losses, params


def test_pipeline_zero3_checkpoint_loads_at_pp1_zero2(tmp_path: Path) -> None:
    save = PipeSpec(pp=2, dp=2, m=2, zero=3, tied=True, steps=4)
    load = PipeSpec(pp=1, dp=2, m=2, zero=2, tied=True, steps=4)
    saved = run_distributed(_save, 4, save, str(tmp_path), timeout=300)[0]
    per_rank = run_distributed(_load, 2, load, str(tmp_path), timeout=300)
    ref_losses, ref_params = reference_run(save)
    for rank, (losses, params) in enumerate(per_rank):
        assert_close_rel(saved + losses, ref_losses, rtol=1e-5, msg=f"rank {rank} losses")
        assert set(params) == set(ref_params)
        for name, value in params.items():
            assert_close_rel(value, ref_params[name], rtol=1e-5, atol=1e-7, msg=f"{rank} {name}")


# ---------------------------------------------------------------------------- pp x dp x tp
TP_WIDTH, TP_LAYERS, TP_STEPS, TP_M = 8, 4, 3, 4


class TPBlock(nn.Module):
    """Residual MLP, column- then row-parallel over the tensor axis: (B, T, W) -> (B, T, W)."""

    def __init__(self, group: Any) -> None:
        super().__init__()
        from shardspeed.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear

        self.up = ColumnParallelLinear(TP_WIDTH, 2 * TP_WIDTH, group=group)
        self.down = RowParallelLinear(2 * TP_WIDTH, TP_WIDTH, group=group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


class FullBlock(nn.Module):
    """The same block unsharded (same init: the TP layers slice a full nn.Linear)."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(TP_WIDTH, 2 * TP_WIDTH)
        self.down = nn.Linear(2 * TP_WIDTH, TP_WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


def _tp_batch(step: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 1009 + index)
    return torch.randn(2, 4, TP_WIDTH, generator=g), torch.randn(2, 4, TP_WIDTH, generator=g)


TP_OPT = {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}}  # see test_tp_engine.py


def _tp_pipeline(dp: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    import shardspeed
    from shardspeed.pipe import LayerSpec, PipelineModule
    from shardspeed.topology import Topology

    topology = Topology.build(pp=2, tp=2, dp=dp)
    group = topology.group("tensor")
    net = PipelineModule(
        [LayerSpec(TPBlock, group) for _ in range(TP_LAYERS)],
        topology=topology,
        loss_fn=F.mse_loss,
        seed_layers=True,
        partition_method="uniform",
    )
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": TP_M,
        "gradient_clipping": 0.05,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "optimizer": TP_OPT,
    }
    engine, _, _, _ = shardspeed.initialize(model=net, config=config)
    d = engine.dp_rank
    data = iter([_tp_batch(s, k * dp + d) for s in range(TP_STEPS) for k in range(TP_M)])
    losses = [float(engine.train_batch(data)) for _ in range(TP_STEPS)]
    state = {k: v.float().clone() for k, v in engine.state_dict().items()}
    engine.destroy()
    return losses, state


def _tp_reference(dp: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    layers = []
    for i in range(TP_LAYERS):
        torch.manual_seed(1234 + i)
        layers.append(FullBlock())
    model = nn.Sequential(*layers)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    n = dp * TP_M
    losses = []
    for step in range(TP_STEPS):
        total = 0.0
        for j in range(n):
            x, y = _tp_batch(step, j)
            loss = F.mse_loss(model(x), y)
            (loss / n).backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()
        opt.zero_grad()
        losses.append(total / n)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.slow
def test_pipeline_zero3_with_tensor_parallel() -> None:
    """pp 2 x dp 2 x tp 2 (8 ranks) at ZeRO-3: every tensor rank's shards are sharded again
    over the data axis, unit by unit, and the losses and full weights equal one process."""
    per_rank = run_distributed(_tp_pipeline, 8, 2, timeout=900)
    ref_losses, ref_state = _tp_reference(2)
    seen: set[str] = set()
    for rank, (losses, state) in enumerate(per_rank):
        assert_close_rel(losses, ref_losses, rtol=1e-5, msg=f"rank {rank} losses")
        for name, value in state.items():
            assert_close_rel(value, ref_state[name], rtol=1e-5, atol=1e-6, msg=f"{rank} {name}")
            seen.add(name)
    assert seen == set(ref_state), set(ref_state) - seen
