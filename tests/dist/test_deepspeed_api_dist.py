"""DeepSpeed's API surface on 2 gloo ranks: ``utils.groups`` over the job's topology,
``engine._zero3_consolidated_16bit_state_dict`` (Accelerate's ZeRO-3 save),
``runtime.utils.clip_grad_norm_``, ``zero.Init`` with a Trainer-style config still holding
``"auto"`` values, and ``utils.zero_to_fp32`` on the checkpoint the ranks saved."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

import shardspeed as deepspeed
from shardspeed.testing import run_distributed

WORLD = 2


def _model(freeze_first: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    if freeze_first:
        model[0].requires_grad_(False)
    return model


def _train(stage: int, ckpt_dir: str, freeze_first: bool = False) -> dict:
    engine, *_ = deepspeed.initialize(
        model=_model(freeze_first),
        config={
            "train_micro_batch_size_per_gpu": 2,
            "steps_per_print": float("inf"),  # Accelerate's value
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": stage},
        },
    )
    rank = deepspeed.comm.get_rank()
    x = torch.randn(2, 6, generator=torch.Generator().manual_seed(rank))
    for _ in range(2):
        engine.backward(engine(x).pow(2).mean())
        engine.step()
    consolidated = engine._zero3_consolidated_16bit_state_dict()
    full = engine.state_dict()
    engine.save_checkpoint(ckpt_dir, tag="step2")
    groups = deepspeed.utils.groups
    return {
        "consolidated": {k: v.clone() for k, v in consolidated.items()},
        "full": {k: v.clone() for k, v in full.items()},
        "groups": (
            groups.get_data_parallel_world_size(),
            groups.get_data_parallel_rank(),
            groups.get_model_parallel_world_size(),
            groups.get_tensor_model_parallel_rank(),
            groups._get_sequence_parallel_world_size(),
            deepspeed.comm.get_world_size(group=groups.get_data_parallel_group()),
        ),
    }


def test_zero3_consolidated_state_dict_groups_and_zero_to_fp32(tmp_path: Path) -> None:
    from shardspeed.utils.zero_to_fp32 import (
        convert_zero_checkpoint_to_fp32_state_dict,
        get_fp32_state_dict_from_zero_checkpoint,
        load_state_dict_from_zero_checkpoint,
    )

    ckpt = tmp_path / "ckpt"
    rank0, rank1 = run_distributed(_train, WORLD, 3, str(ckpt))
    assert rank1["consolidated"] == {}
    assert set(rank0["consolidated"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    for name, tensor in rank0["full"].items():
        assert torch.equal(rank0["consolidated"][name], tensor), name
        assert torch.equal(rank1["full"][name], tensor), name  # the gather is collective
    assert rank0["groups"] == (2, 0, 1, 0, 1, 2) and rank1["groups"] == (2, 1, 1, 0, 1, 2)

    state = get_fp32_state_dict_from_zero_checkpoint(ckpt)  # tag from "latest"
    for name, tensor in rank0["full"].items():
        torch.testing.assert_close(state[name], tensor.float())
    model = load_state_dict_from_zero_checkpoint(_model(), ckpt, tag="step2")
    assert torch.equal(model[2].weight.detach(), state["2.weight"])
    out = tmp_path / "hf"
    convert_zero_checkpoint_to_fp32_state_dict(ckpt, out, safe_serialization=True)
    assert (out / "model.safetensors").is_file()
    cli = [sys.executable, "-m", "shardspeed.utils.zero_to_fp32", str(ckpt), str(tmp_path / "cli")]
    subprocess.run(cli, check=True, timeout=120)
    cli_state = torch.load(tmp_path / "cli" / "pytorch_model.bin", weights_only=True)
    assert all(torch.equal(cli_state[k], v) for k, v in state.items())


def test_zero_to_fp32_excludes_frozen_parameters(tmp_path: Path) -> None:
    from shardspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    ckpt = tmp_path / "ckpt"
    run_distributed(_train, WORLD, 2, str(ckpt), True)
    everything = get_fp32_state_dict_from_zero_checkpoint(ckpt)
    trained = get_fp32_state_dict_from_zero_checkpoint(ckpt, exclude_frozen_parameters=True)
    assert set(everything) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert set(trained) == {"2.weight", "2.bias"}


def _clip(norm_type: float) -> tuple[float, list[torch.Tensor]]:
    from shardspeed.runtime.utils import clip_grad_norm_

    torch.manual_seed(1)  # same gradients on every rank, as after a data-parallel reduction
    params = [torch.nn.Parameter(torch.randn(5, 4)) for _ in range(2)]
    for p in params:
        p.grad = torch.randn_like(p) * 3
    total = clip_grad_norm_(params, max_norm=0.5, norm_type=norm_type)
    return float(total), [p.grad for p in params]


def test_clip_grad_norm_averages_over_data_parallel_ranks() -> None:
    for norm_type in (2.0, float("inf")):
        results = run_distributed(_clip, WORLD, norm_type)
        torch.manual_seed(1)
        ref = [torch.nn.Parameter(torch.randn(5, 4)) for _ in range(2)]
        for p in ref:
            p.grad = torch.randn_like(p) * 3
        expected = torch.nn.utils.clip_grad_norm_(ref, max_norm=0.5, norm_type=norm_type)
        for total, grads in results:
            assert abs(total - float(expected)) < 1e-4
            for g, p in zip(grads, ref):
                torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-6)


_TRAINER_STYLE_CONFIG = {
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "bf16": {"enabled": True},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {"warmup_num_steps": "auto", "total_num_steps": "auto"},
    },
    "zero_optimization": {
        "stage": 3,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
    },
}


def _init_with_auto() -> tuple[torch.dtype, int]:
    with deepspeed.zero.Init(config_dict_or_path=_TRAINER_STYLE_CONFIG):
        layer = torch.nn.Linear(8, 4)
    return layer.weight.dtype, layer.weight.ds_numel


def test_zero_init_accepts_unresolved_auto_values() -> None:
    assert run_distributed(_init_with_auto, WORLD) == [(torch.bfloat16, 32)] * WORLD
