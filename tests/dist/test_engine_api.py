"""Engine semantics users rely on: GAS boundaries, fp16 overflow skipping, no_sync rules,
client optimizers/schedulers, the dataloader, monitors and the flops profiler."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest
import torch

import shardspeed
from shardspeed.models import GPT, GPTConfig
from shardspeed.testing import run_distributed


def _model(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(5))
    return t[:, :-1], t[:, 1:]


def _boundaries() -> list[bool]:
    engine, *_ = shardspeed.initialize(
        model=_model(),
        config={
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 2,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        },
    )
    seen = []
    for _ in range(8):
        x, y = _batch()
        seen.append(engine.is_gradient_accumulation_boundary())
        engine.backward(engine(x, y)[1])
        engine.step()
    assert engine.global_steps == 4 and engine.micro_steps == 8
    return seen


def _fp16_overflow() -> dict:
    engine, _, _, sched = shardspeed.initialize(
        model=_model(),
        config={
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "scheduler": {
                "type": "WarmupLR",
                "params": {"warmup_max_lr": 1e-3, "warmup_num_steps": 10},
            },
            "fp16": {"enabled": True, "initial_scale_power": 10, "hysteresis": 1},
            "zero_optimization": {"stage": 2},
        },
    )
    before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    lr_before = engine.get_lr()[0]
    x, y = _batch()
    loss = engine(x, y)[1]
    engine.backward(loss * float("inf"))
    engine.step()
    unchanged = all(torch.equal(before[n], p) for n, p in engine.module.named_parameters())
    out = {
        "skipped": engine.skipped_steps,
        "applied": engine.was_step_applied(),
        "global_steps": engine.global_steps,
        "scale": engine.loss_scaler.loss_scale,
        "lr_unchanged": engine.get_lr()[0] == lr_before,
        "params_unchanged": unchanged,
    }
    engine.backward(engine(x, y)[1])
    engine.step()
    out["applied_after"] = engine.was_step_applied()
    return out


def _no_sync_rules() -> list[str]:
    messages = []
    e2, *_ = shardspeed.initialize(
        model=_model(),
        config={
            "train_micro_batch_size_per_gpu": 2,
            "zero_optimization": {"stage": 2},
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        },
    )
    with pytest.raises(RuntimeError) as err:
        with e2.no_sync():
            pass
    messages.append(str(err.value))
    e0, *_ = shardspeed.initialize(
        model=_model(),
        config={
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        },
    )
    x, y = _batch()
    with pytest.raises(RuntimeError) as err:
        with e0.no_sync():
            e0.backward(e0(x, y)[1])
            e0.step()
    messages.append(str(err.value))
    return messages


def _client_optimizer_and_scheduler() -> tuple[list[float], list[float]]:
    model = _model()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "lr": 0.01}, {"params": other, "lr": 0.02}])
    engine, eng_opt, _, sched = shardspeed.initialize(
        model=model,
        optimizer=opt,
        lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5),
        config={"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1}},
    )
    first = engine.get_lr()
    x, y = _batch()
    engine.backward(engine(x, y)[1])
    engine.step()
    assert eng_opt.optimizer is opt and isinstance(sched, torch.optim.lr_scheduler.StepLR)
    return first, engine.get_lr()


def _dataloader_shards() -> list[int]:
    data = torch.utils.data.TensorDataset(torch.arange(16))
    engine, _, loader, _ = shardspeed.initialize(
        model=_model(),
        training_data=data,
        config={
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        },
    )
    return sorted(int(v) for (batch,) in loader for v in batch)


def _monitors_and_profiler(out_dir: str) -> None:
    engine, *_ = shardspeed.initialize(
        model=_model(),
        config={
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "steps_per_print": 2,
            "wall_clock_breakdown": True,
            "csv_monitor": {"enabled": True, "output_path": out_dir, "job_name": "job"},
            "flops_profiler": {
                "enabled": True,
                "profile_step": 2,
                "output_file": f"{out_dir}/profile.txt",
            },
            "comms_logger": {"enabled": True},
        },
    )
    for _ in range(3):
        x, y = _batch()
        engine.backward(engine(x, y)[1])
        engine.step()
    engine.destroy()


def test_gradient_accumulation_boundaries() -> None:
    seen = run_distributed(_boundaries, 2)[0]
    assert seen == [False, True] * 4


def test_fp16_overflow_skips_step_and_scheduler() -> None:
    out = run_distributed(_fp16_overflow, 2)[0]
    assert out["skipped"] == 1 and not out["applied"] and out["global_steps"] == 1
    assert out["scale"] == 2.0**9  # hysteresis 1: halved on the first overflow
    assert out["lr_unchanged"] and out["params_unchanged"] and out["applied_after"]


def test_no_sync_rules() -> None:
    stage2, step_inside = run_distributed(_no_sync_rules, 2)[0]
    assert "incompatible with zero_optimization.stage=2" in stage2
    assert "inside engine.no_sync()" in step_inside


def test_client_optimizer_groups_and_callable_scheduler() -> None:
    first, after = run_distributed(_client_optimizer_and_scheduler, 2)[0]
    assert first == [0.01, 0.02] and after == [0.005, 0.01]


def test_dataloader_gives_each_rank_a_disjoint_share() -> None:
    r0, r1 = run_distributed(_dataloader_shards, 2)
    assert not set(r0) & set(r1) and sorted(r0 + r1) == list(range(16))


def test_monitors_and_flops_profiler(tmp_path: Path) -> None:
    run_distributed(_monitors_and_profiler, 2, str(tmp_path))
    files = {p.name for p in (tmp_path / "job").iterdir()}
    assert {"Train_Samples_lr.csv", "Train_Samples_train_loss.csv"} <= files
    assert "Train_Samples_elapsed_time_ms_forward.csv" in files
    rows = (tmp_path / "job" / "Train_Samples_lr.csv").read_text().splitlines()
    assert rows[0] == "step,lr" and len(rows) == 4  # header + 3 steps, written once (rank 0)
    profile = (tmp_path / "profile.txt").read_text()
    assert "FLOPs" in profile or "flops" in profile.lower()


def test_initialize_config_errors() -> None:
    args = argparse.Namespace(deepspeed_config="x.json")
    with pytest.raises(ValueError, match="both as args.deepspeed_config and as config="):
        shardspeed.initialize(args=args, model=_model(), config={"train_batch_size": 2})
    with pytest.raises(ValueError, match="needs a config"):
        shardspeed.initialize(model=_model())
    with pytest.raises(ValueError, match="requires model="):
        shardspeed.initialize(config={"train_batch_size": 2})


def _adafactor_rejected() -> str:
    model = _model()
    with pytest.raises(ValueError) as err:
        shardspeed.initialize(
            model=model,
            optimizer=torch.optim.Adafactor(model.parameters()),  # per-tensor factored moments
            config={"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1}},
        )
    return str(err.value)


def test_per_parameter_norm_optimizer_rejected_with_reason() -> None:
    """Not elementwise and no set_param_segments (LAMB has it: tests/dist/test_lamb_engine.py)."""
    msg = run_distributed(_adafactor_rejected, 2)[0]
    assert "Adafactor" in msg and "zero_optimization.stage=1" in msg and "elementwise" in msg


def test_add_config_arguments() -> None:
    parser = shardspeed.add_config_arguments(argparse.ArgumentParser())
    ns = parser.parse_args(["--deepspeed", "--deepspeed_config", "cfg.json"])
    assert ns.deepspeed and ns.deepspeed_config == "cfg.json"
    assert os.path.basename(ns.deepspeed_config) == "cfg.json"


def _activation_checkpointing_config(stage: int) -> dict:
    from shardspeed import checkpointing

    checkpointing.reset()
    shardspeed.initialize(
        model=_model(),
        config={
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "zero_optimization": {"stage": stage},
            "activation_checkpointing": {"cpu_checkpointing": True},
        },
    )
    return {"configured": checkpointing.is_configured(), "settings": str(checkpointing.settings())}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_engine_applies_activation_checkpointing_block(stage: int) -> None:
    # one engine for every stage: stage 3 once had its own copy of the setup and skipped it
    out = run_distributed(_activation_checkpointing_config, 2, stage)[0]
    assert out["configured"] and "cpu_checkpointing=True" in out["settings"]


def _offload_at_stage0() -> str:
    with pytest.raises(ValueError) as err:
        shardspeed.initialize(
            model=_model(),
            config={
                "train_micro_batch_size_per_gpu": 2,
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                "zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}},
            },
        )
    return str(err.value)


def test_optimizer_offload_at_stage0_is_an_error_not_ignored() -> None:
    # stages 1-3 offload (tests/dist/test_offload_parity.py); stage 0 has no sharded optimizer
    msg = run_distributed(_offload_at_stage0, 2)[0]
    assert "offload_optimizer" in msg and "stage 1, 2 or 3" in msg
