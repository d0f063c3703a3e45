"""One dense training client for the 16-bit ZeRO-0 oracle, run by both libraries.

:func:`train_cases` is written against DeepSpeed's API and runs under DeepSpeed 0.19.8
(``.venv-peers``, started by ``torch.distributed.run`` with this file as the script) and
under ShardSpeed (``import shardspeed as deepspeed``, spawned by ``run_distributed``).
Model: a tiny dense language model (embedding -> residual GELU MLP -> LayerNorm -> head),
loss ``LOSS_GAIN x`` cross-entropy in fp32 (gradient norms about 2), weight decay 0.1,
ZeRO stage 0, gradient clipping 1.0 at bf16 (active at every step) and none at fp16
(DeepSpeed 0.19.8's fp16 stage 0 does not scale the loss it then unscales, so it clips
against a threshold 256x too high: test_bf16_stage0_deepspeed_losses.py).

A case is ``"precision:optimizer:gas"``: precision ``bf16`` or ``fp16``; optimizer
``config`` (``"optimizer": {"type": "AdamW"}``: DeepSpeed's ``FusedAdam`` behind
``FP16_Optimizer``), ``client`` (a ``torch.optim.AdamW`` instance: DeepSpeed's
``FP16_UnfusedOptimizer``), ``sgd`` (a client ``torch.optim.SGD`` with momentum) or
``client-none`` (ShardSpeed only: ``client`` with ``"initial_zero_grad_step": "none"``).
Per case: every micro-step's loss, every step's ``get_global_grad_norm()`` and the
optimizer's step count at the end (Adam's ``step`` state; None for SGD).

DeepSpeed's CPU accelerator says fp16 is unsupported and ``initialize`` refuses it; the
DeepSpeed rank overrides that capability check (``is_fp16_supported``) so its fp16 ZeRO-0
wrappers, loss scaler included, run on CPU (torch's CPU kernels compute fp16).

As a script (one DeepSpeed rank): ``argv = [result_dir, case, case, ...]``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

VOCAB, HIDDEN, FFN, BATCH, SEQ, STEPS = 32, 16, 32, 2, 8, 4
LR, WEIGHT_DECAY, CLIP, LOSS_GAIN = 1e-2, 0.1, 1.0, 3.0


class DenseLM(torch.nn.Module):
    """``ids (BATCH, SEQ) -> logits (BATCH, SEQ, VOCAB)``; the loss is computed in fp32."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.fc1 = torch.nn.Linear(HIDDEN, FFN)
        self.fc2 = torch.nn.Linear(FFN, HIDDEN)
        self.norm = torch.nn.LayerNorm(HIDDEN)
        self.head = torch.nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)  # (BATCH, SEQ, HIDDEN)
        h = h + self.fc2(torch.nn.functional.gelu(self.fc1(h)))
        logits = self.head(self.norm(h)).float()  # (BATCH, SEQ, VOCAB)
        loss = torch.nn.functional.cross_entropy(logits.view(-1, VOCAB), labels.reshape(-1))
        return LOSS_GAIN * loss  # gradient norms ~2: above CLIP


def parse_case(text: str) -> tuple[str, str, int]:
    precision, optimizer, gas = text.split(":")
    return precision, optimizer, int(gas)


def _config(precision: str, gas: int) -> dict[str, Any]:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": CLIP if precision == "bf16" else 0.0,  # fp16: module docstring
        "zero_optimization": {"stage": 0},
    }
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    else:  # a small initial scale: no overflow-skipped steps in either library
        config["fp16"] = {"enabled": True, "initial_scale_power": 8}
    return config


def _initialize(ds: Any, model: torch.nn.Module, case: str) -> Any:
    precision, opt, gas = parse_case(case)
    config = _config(precision, gas)
    if opt == "config":
        params = {"lr": LR, "weight_decay": WEIGHT_DECAY}
        config["optimizer"] = {"type": "AdamW", "params": params}
        engine, _, _, _ = ds.initialize(
            model=model, model_parameters=model.parameters(), config=config
        )
        return engine
    if opt == "sgd":
        optimizer = torch.optim.SGD(
            model.parameters(), lr=LR, momentum=0.9, weight_decay=WEIGHT_DECAY
        )
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    if opt == "client-none":
        config["initial_zero_grad_step"] = "none"
    engine, _, _, _ = ds.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def _step_count(optimizer: torch.optim.Optimizer) -> int | None:
    counts = [int(s["step"]) for s in optimizer.state.values() if "step" in s]
    return max(counts) if counts else None


def train_cases(ds: Any, cases: list[str]) -> dict[str, dict[str, Any]]:
    """Every case on this rank; only torch and DeepSpeed's API."""
    rank = torch.distributed.get_rank()
    results: dict[str, dict[str, Any]] = {}
    for case in cases:
        gas = parse_case(case)[2]
        torch.manual_seed(1234)
        engine = _initialize(ds, DenseLM(), case)
        losses, norms = [], []
        for step in range(STEPS):
            for micro in range(gas):
                g = torch.Generator().manual_seed(100 * step + 10 * micro + rank)
                tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
                loss = engine(tokens[:, :-1], tokens[:, 1:])
                engine.backward(loss)
                engine.step()
                losses.append(float(loss.detach()))
            norm = engine.get_global_grad_norm()
            norms.append(None if norm is None else float(norm))
        steps = _step_count(engine.basic_optimizer)
        results[case] = {"losses": losses, "norms": norms, "steps": steps}
        if hasattr(engine, "destroy"):
            engine.destroy()
    return results


def deepspeed_rank(result_dir: str, cases: list[str]) -> None:
    """One DeepSpeed rank (under torch.distributed.run in the peers venv)."""
    import deepspeed
    import deepspeed.comm.torch as ds_comm_torch
    from deepspeed.accelerator import get_accelerator

    ds_comm_torch.build_shm_op = lambda: None  # skip a JIT build the gloo test never uses
    get_accelerator().is_fp16_supported = lambda: True  # run the fp16 wrappers on CPU
    deepspeed.init_distributed(dist_backend="gloo")
    torch.set_num_threads(1)
    results = train_cases(deepspeed, cases)
    torch.save(results, Path(result_dir) / f"rank{torch.distributed.get_rank()}.pt")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def shardspeed_rank(cases: list[str]) -> dict[str, dict[str, Any]]:
    """One ShardSpeed rank (under ``run_distributed``)."""
    import shardspeed as deepspeed

    return train_cases(deepspeed, cases)


if __name__ == "__main__":  # a DeepSpeed rank
    deepspeed_rank(sys.argv[1], sys.argv[2:])
