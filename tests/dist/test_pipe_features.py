"""PipelineEngine features on 2 ranks: tuple activations, eval_batch, mixed precision,
training_data, dynamic shapes, and the errors of forward/backward/step."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from shardspeed.testing import assert_close_rel, run_distributed

W = 8


class Masked(nn.Module):
    """(x, mask) -> (x + tanh(fc(x)) * mask, mask): a tuple with a non-float member."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(W, W)

    def forward(
        self, inputs: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, mask = inputs
        return x + torch.tanh(self.fc(x)) * mask.unsqueeze(-1), mask


def add_mask(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x, x[..., 0] > 0  # (B, T, W) -> ((B, T, W), (B, T) bool)


def drop_mask(inputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return inputs[0]


def layers() -> list[Any]:
    from shardspeed.pipe import LayerSpec

    return [add_mask] + [LayerSpec(Masked) for _ in range(4)] + [drop_mask]


def batch(i: int, seq: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(2, seq, W, generator=g), torch.randn(2, seq, W, generator=g)


def config(**extra: Any) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 4,
        "gradient_clipping": 1.0,
        "steps_per_print": 10_000,
        "zero_optimization": {"stage": 1},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        **extra,
    }


def reference(steps: int, precision: str = "fp32") -> tuple[list[float], float]:
    from shardspeed.pipe import LayerSpec

    mods = []
    for i, layer in enumerate(layers()):
        torch.manual_seed(1234 + i)
        mods.append(layer.build() if isinstance(layer, LayerSpec) else layer)
    params = [p for m in mods if isinstance(m, nn.Module) for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)

    def run(x: torch.Tensor) -> torch.Tensor:
        for m in mods:
            x = m(x)
        return x

    losses = []
    for step in range(steps):
        total = 0.0
        for k in range(4):
            x, y = batch(step * 4 + k)
            loss = F.mse_loss(run(x), y)
            (loss / 4).backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(total / 4)
    with torch.no_grad():
        eval_loss = (
            sum(F.mse_loss(run(batch(1000 + k)[0]), batch(1000 + k)[1]).item() for k in range(4))
            / 4
        )
    return losses, eval_loss


def _mse_fp32(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The loss in fp32 whatever the activations' dtype: torch 2.11's ``mse_loss`` cannot
    differentiate a bf16 output against an fp32 target (2.13 can)."""
    return F.mse_loss(out.float(), target.float())


def _engine(precision: str = "fp32", **module_kwargs: Any) -> Any:
    import shardspeed
    from shardspeed.pipe import PipelineModule

    net = PipelineModule(
        layers(), num_stages=2, loss_fn=_mse_fp32, seed_layers=True, **module_kwargs
    )
    extra = {"bf16": {"enabled": True}} if precision == "bf16" else {}
    if precision == "fp16":
        extra = {"fp16": {"enabled": True, "initial_scale_power": 8}}
    engine, opt, _, _ = shardspeed.initialize(model=net, config=config(**extra))
    return engine


def _count_meta_exchanges(engine: Any) -> list[int]:
    """Count shape negotiations (sent on stage 0, received on stage 1)."""
    link, count = engine.link, [0]
    name = "_send_meta" if engine.is_first_stage() else "_recv_meta_from"
    original = getattr(link, name)

    def counted(*args: Any) -> Any:
        count[0] += 1
        return original(*args)

    setattr(link, name, counted)
    return count


def _features() -> dict[str, Any]:
    from shardspeed.pipe import PipelineError

    out: dict[str, Any] = {}
    engine = _engine(schedule="gpipe")
    metas = _count_meta_exchanges(engine)
    data = iter([batch(i) for i in range(12)])
    out["losses"] = [float(engine.train_batch(data)) for _ in range(3)]
    out["metas"] = metas[0]  # shapes negotiated on the first micro-batch only
    out["eval"] = float(engine.eval_batch(iter([batch(1000 + k) for k in range(4)])))
    per_mb, logits = engine.eval_batch(
        iter([batch(1000 + k) for k in range(4)]), return_logits=True, reduce_output=None
    )
    out["per_mb"] = None if per_mb is None else [float(x) for x in per_mb]
    out["logits_shapes"] = None if logits is None else [tuple(t.shape) for t in logits]
    for call in (lambda: engine(batch(0)[0]), lambda: engine.backward(None), engine.step):
        with pytest.raises(PipelineError, match="train_batch"):
            call()
    out["first_last"] = (
        engine.is_first_stage(),
        engine.is_last_stage(),
        engine.stage_id,
        engine.num_stages,
    )
    engine.destroy()

    for precision in ("bf16", "fp16"):
        engine = _engine(precision)
        data = iter([batch(i) for i in range(12)])
        out[precision] = [float(engine.train_batch(data)) for _ in range(3)]
        out[f"{precision}_skipped"] = engine.skipped_steps
        engine.destroy()

    # activation checkpointing every 2 layers (shardspeed.checkpointing.checkpoint)
    engine = _engine(activation_checkpoint_interval=2)
    data = iter([batch(i) for i in range(12)])
    out["ckpt"] = [float(engine.train_batch(data)) for _ in range(3)]
    engine.destroy()

    # dynamic shapes: the sequence length changes from batch to batch
    engine = _engine(dynamic_shape=True)
    metas = _count_meta_exchanges(engine)
    data = iter([batch(i, seq=2 + i % 3) for i in range(8)])
    out["dynamic"] = [float(engine.train_batch(data)) for _ in range(2)]
    out["dynamic_metas"] = metas[0]
    engine.destroy()
    return out


def _training_data() -> list[float]:
    import shardspeed
    from shardspeed.pipe import PipelineModule

    dataset = [batch(i) for i in range(8)]
    dataset = [(x[j], y[j]) for x, y in dataset for j in range(2)]
    net = PipelineModule(layers(), num_stages=2, loss_fn=F.mse_loss, seed_layers=True)
    engine, _, loader, _ = shardspeed.initialize(model=net, config=config(), training_data=dataset)
    assert loader is not None
    losses = [float(engine.train_batch()) for _ in range(3)]  # repeats past one epoch
    engine.destroy()
    return losses


def test_pipeline_features() -> None:
    per_rank = run_distributed(_features, 2, timeout=300)
    ref_losses, ref_eval = reference(3)
    first, last = per_rank
    for rank, out in enumerate(per_rank):
        assert_close_rel(out["losses"], ref_losses, rtol=1e-5, msg=f"rank {rank} tuple losses")
        assert_close_rel(out["eval"], ref_eval, rtol=1e-5, msg=f"rank {rank} eval")
        assert_close_rel(out["ckpt"], ref_losses, rtol=1e-5, msg=f"rank {rank} checkpointed")
        assert_close_rel(out["bf16"], ref_losses, rtol=3e-2, msg=f"rank {rank} bf16")
        assert_close_rel(out["fp16"], ref_losses, rtol=5e-3, msg=f"rank {rank} fp16")
        assert all(torch.isfinite(torch.tensor(out["dynamic"])))
    assert first["first_last"] == (True, False, 0, 2) and last["first_last"] == (False, True, 1, 2)
    assert first["per_mb"] is None and first["logits_shapes"] is None
    assert len(last["per_mb"]) == 4 and abs(sum(last["per_mb"]) / 4 - ref_eval) < 1e-5
    assert last["logits_shapes"] == [(2, 4, W)] * 4
    assert first["fp16_skipped"] == last["fp16_skipped"]
    assert first["dynamic"] == last["dynamic"]
    assert first["metas"] == last["metas"] == 1  # 3 batches x 4 micro-batches, cached
    assert first["dynamic_metas"] == last["dynamic_metas"] == 8  # every micro-batch


def test_pipeline_training_data() -> None:
    per_rank = run_distributed(_training_data, 2, timeout=300)
    assert per_rank[0] == per_rank[1] and len(per_rank[0]) == 3
    assert all(torch.isfinite(torch.tensor(per_rank[0])))
