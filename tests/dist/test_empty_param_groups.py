"""Empty and frozen-only parameter groups are kept, as DeepSpeed keeps them.

The Hugging Face Trainer always builds a decay and a no-decay group; in a LoRA fine-tune of
a frozen base the no-decay group holds only frozen parameters, so it arrives empty. The
engine must train the other groups as if it were absent, keep the group in the optimizer
(LR schedulers and checkpoints count groups) and save / load it.

Reference: one process, plain PyTorch, the same frozen parameters and the same groups (the
empty one included); fp32, so losses and parameters agree within 1e-5 relative.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from parity_common import ParitySpec, make_model, micro_batch

from shardspeed.testing import run_distributed

TOL = {"rtol": 1e-5, "atol": 1e-6}
STEPS = 4
WORLD = 2


def _groups(model: torch.nn.Module, frozen_prefix: str) -> list[dict]:
    """Decay / no-decay / frozen-only groups after freezing ``frozen_prefix*`` parameters."""
    for name, p in model.named_parameters():
        p.requires_grad_(not name.startswith(frozen_prefix))
    named = list(model.named_parameters())
    return [
        {"params": [p for n, p in named if p.dim() >= 2 and p.requires_grad], "weight_decay": 0.1},
        # the norms, frozen below: a group that arrives frozen-only
        {"params": [p for n, p in named if p.dim() < 2 and p.requires_grad], "weight_decay": 0.0},
        {"params": [p for n, p in named if not p.requires_grad], "weight_decay": 0.0},
    ]


def _frozen_prefix() -> str:
    return "h.0."  # the first block (its weights and layer norms)


def _freeze_norms(model: torch.nn.Module) -> None:
    for p in model.parameters():
        if p.dim() < 2:
            p.requires_grad_(False)


def _optimizer(groups: list[dict]) -> torch.optim.Optimizer:
    # SGD + momentum: rounding differences in the order tied-weight gradients are summed stay
    # proportional (Adam turns them into whole +-lr steps on near-zero gradients)
    return torch.optim.SGD(groups, lr=0.05, momentum=0.9)


def _scheduler() -> dict:
    return {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.05, "warmup_num_steps": 3},
    }


def _reference(spec: ParitySpec) -> tuple[list[float], dict[str, torch.Tensor]]:
    from shardspeed.runtime.lr_schedules import build_lr_scheduler

    model = make_model(spec)
    groups = _groups(model, _frozen_prefix())
    _freeze_norms(model)
    opt = _optimizer(groups)
    sched = build_lr_scheduler("WarmupLR", dict(_scheduler()["params"]), opt)
    losses = []
    for step in range(STEPS):
        total = 0.0
        grads = None
        for r in range(WORLD):
            x, y = micro_batch(spec, step, r)
            _, loss = model(x, y)
            loss.backward()
            total += float(loss.detach())
            mine = [p.grad.clone() for p in model.parameters() if p.requires_grad]
            grads = mine if grads is None else [g + m for g, m in zip(grads, mine)]
            model.zero_grad(set_to_none=True)
        for p, g in zip([p for p in model.parameters() if p.requires_grad], grads):
            p.grad = g / WORLD
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total / WORLD)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _engine_run(spec: ParitySpec, stage: int, save_dir: str) -> dict:
    import shardspeed
    from shardspeed import comm

    model = make_model(spec)
    groups = _groups(model, _frozen_prefix())
    _freeze_norms(model)
    opt = _optimizer(groups)
    config = {
        "train_micro_batch_size_per_gpu": spec.micro,
        "zero_optimization": {"stage": stage},
        "gradient_clipping": 0.0,  # DeepSpeed clips at 1.0 by default; the reference does not
        "scheduler": _scheduler(),
    }
    engine, optimizer, _, sched = shardspeed.initialize(model=model, optimizer=opt, config=config)
    rank = comm.get_rank()
    losses = []
    for step in range(STEPS):
        x, y = micro_batch(spec, step, rank)
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        comm.all_reduce(total)
        losses.append(float(total) / WORLD)
    out = {
        "losses": losses,
        "num_groups": len(optimizer.param_groups),
        "lrs": [g["lr"] for g in optimizer.param_groups],
        "empty_group": [len(g["params"]) for g in optimizer.param_groups],
    }
    engine.save_checkpoint(save_dir, tag="t")
    out["params"] = {n: p.detach().float().clone() for n, p in _full_params(engine).items()}
    engine.destroy()

    # a fresh engine with the same three groups loads the checkpoint, group count and all
    model = make_model(spec)
    groups = _groups(model, _frozen_prefix())
    _freeze_norms(model)
    engine, optimizer, _, _ = shardspeed.initialize(
        model=model, optimizer=_optimizer(groups), config=config
    )
    engine.load_checkpoint(save_dir, tag="t")
    out["loaded_lrs"] = [g["lr"] for g in optimizer.param_groups]
    out["loaded_params"] = {n: p.detach().float().clone() for n, p in _full_params(engine).items()}
    engine.destroy()
    return out


def _full_params(engine) -> dict[str, torch.Tensor]:
    from shardspeed.zero import GatheredParameters

    params = list(engine.module.parameters())
    with GatheredParameters(params):
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_empty_and_frozen_only_groups_train_and_checkpoint(stage: int, tmp_path: Path) -> None:
    spec = ParitySpec(stage=stage, micro=2, world=WORLD)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks run
    try:
        ref_losses, ref_params = _reference(spec)
    finally:
        torch.set_num_threads(threads)
    results = run_distributed(_engine_run, WORLD, spec, stage, str(tmp_path), timeout=240)
    for rank, out in enumerate(results):
        assert out["num_groups"] == 3, f"rank {rank}: groups were dropped"
        assert out["empty_group"][2] == 0
        assert len(set(out["lrs"])) == 1  # the scheduler set every group, the empty one too
        torch.testing.assert_close(torch.tensor(out["losses"]), torch.tensor(ref_losses), **TOL)
        for name, ref in ref_params.items():
            torch.testing.assert_close(
                out["params"][name], ref, **TOL, msg=lambda m, n=name: f"{n}: {m}"
            )
            torch.testing.assert_close(
                out["loaded_params"][name], ref, **TOL, msg=lambda m, n=name: f"{n}: {m}"
            )
        assert out["loaded_lrs"] == out["lrs"]


def _initialize_frozen_model() -> str:
    import shardspeed

    model = make_model(ParitySpec())
    for p in model.parameters():
        p.requires_grad_(False)
    try:
        shardspeed.initialize(
            model=model,
            model_parameters=model.parameters(),
            config={"train_batch_size": 1, "optimizer": {"type": "AdamW"}},
        )
    except ValueError as err:
        return str(err)
    return "no error"


def test_no_trainable_parameter_is_a_clear_error() -> None:
    # in a worker: initialize() joins a process group, which must not outlive the test
    message = run_distributed(_initialize_frozen_model, 1)[0]
    assert "no trainable parameter" in message and "requires_grad=False" in message
