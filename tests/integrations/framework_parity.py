"""What the framework workers share (TRL, PEFT on the Hugging Face Trainer): the ds_config,
the micro-batch recorder, and the plain PyTorch replay the recorded losses are checked against.

The pattern is ``hf_trainer_worker.py``'s: a Trainer subclass records every micro-batch the
model sees (its tensors, the Trainer's ``num_items_in_batch``, the loss ``compute_loss``
returned and what the Trainer divides it by before ``backward``); the records of all ranks
are all-gathered; :func:`replay` runs them through the same initial weights in plain
PyTorch: per optimizer step every rank's micro-batches, gradients summed and divided by the
number of ranks (data parallelism), ``clip_grad_norm_``, ``torch.optim.AdamW`` and the
Trainer's linear warm-up schedule.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer
from transformers.optimization import get_linear_schedule_with_warmup

Record = dict[str, Any]


def ds_config(stage: int) -> dict[str, Any]:
    """The ds_config a Trainer user writes: ZeRO ``stage``, every size ``"auto"``; the
    Trainer's own optimizer and schedule (none in the config)."""
    zero: dict[str, Any] = {"stage": stage, "reduce_bucket_size": "auto"}
    if stage == 3:
        zero.update(
            {
                "stage3_param_persistence_threshold": "auto",
                "stage3_prefetch_bucket_size": "auto",
                "stage3_gather_16bit_weights_on_model_save": True,
            }
        )
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": zero,
    }


class RecordingMixin:
    """Put before a ``Trainer`` subclass: ``self.records`` gets one entry per micro-batch."""

    records: list[Record]

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):  # type: ignore[no-untyped-def]
        tensors = {k: v.detach().cpu().tolist() for k, v in inputs.items() if torch.is_tensor(v)}
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)  # type: ignore[misc]
        n = None if num_items_in_batch is None else int(num_items_in_batch)
        self.records.append(
            {
                "inputs": tensors,
                "n": n,
                "scale": self.world_scale(n),
                "divisor": 1 if self.scaled_for_ga(n) else self.current_gradient_accumulation_steps,  # type: ignore[attr-defined]
                "step": self.state.global_step,  # type: ignore[attr-defined]
                "loss": float(loss.detach()),
            }
        )
        return loss

    def world_scale(self, n: int | None) -> int:
        """The factor ``Trainer.compute_loss`` multiplies a token-averaged loss by (the ranks)."""
        args = self.args  # type: ignore[attr-defined]
        if args.average_tokens_across_devices and n is not None:
            return int(self.accelerator.num_processes)  # type: ignore[attr-defined]
        return 1

    def scaled_for_ga(self, n: int | None) -> bool:
        """``Trainer.training_step``'s rule: is the loss already divided for accumulation?"""
        declared = getattr(self, "loss_is_scaled_for_ga", None)
        if declared is not None:
            return bool(declared)
        accepts = bool(getattr(self, "model_accepts_loss_kwargs", False))
        return (accepts and n is not None) or getattr(self, "compute_loss_func", None) is not None


def gather_records(records: list[Record]) -> list[list[Record]]:
    """Every rank's records, indexed by rank (one rank: ``[records]``)."""
    if not (torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1):
        return [records]
    by_rank: list[list[Record]] = [[] for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather_object(by_rank, records)
    return by_rank


def trainer_param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """``Trainer.create_optimizer``'s groups: decay / no-decay over the trainable parameters
    (a group left empty, as the no-decay one is when only LoRA adapters train, is dropped)."""
    decay = set(Trainer.get_decay_parameter_names(None, model))  # type: ignore[arg-type]
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for n, p in named if n in decay], "weight_decay": weight_decay},
        {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
    ]
    return [group for group in groups if group["params"]]


def replay(
    by_rank: list[list[Record]],
    model: torch.nn.Module,
    loss_of: Callable[[torch.nn.Module, Record], torch.Tensor],
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    max_norm: float,
    warmup: int,
    steps: int,
) -> list[list[float]]:
    """Plain PyTorch over the recorded micro-batches; returns every rank's losses as
    ``loss_of`` computes them (the value ``compute_loss`` returned, before any division)."""
    world = len(by_rank)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    groups = trainer_param_groups(model, weight_decay)
    opt = torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps)
    sched = get_linear_schedule_with_warmup(opt, warmup, steps)
    losses: list[list[float]] = [[] for _ in by_rank]
    for step in sorted({r["step"] for records in by_rank for r in records}):
        for rank, records in enumerate(by_rank):
            for record in (r for r in records if r["step"] == step):
                loss = loss_of(model, record)
                (loss / record["divisor"]).backward()
                losses[rank].append(float(loss.detach()))
        for p in params:
            if p.grad is not None:
                p.grad.div_(world)
        torch.nn.utils.clip_grad_norm_(params, max_norm)
        opt.step()
        sched.step()
        opt.zero_grad()
    return losses


def tensors(record: Record, *keys: str) -> list[torch.Tensor]:
    """The recorded inputs ``keys`` as tensors."""
    return [torch.tensor(record["inputs"][key]) for key in keys]


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def write_result(out: Path, result: dict[str, Any]) -> None:
    """Rank 0 writes ``result.json``, rank r > 0 ``result_rank{r}.json``."""
    name = "result.json" if rank() == 0 else f"result_rank{rank()}.json"
    (out / name).write_text(json.dumps(result))
