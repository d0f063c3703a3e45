"""Worker: Hugging Face ``Trainer(deepspeed=ds_config)`` on shardspeed vs a plain PyTorch loop.

    python hf_trainer_worker.py OUT_DIR VARIANT

Runs in a subprocess with the ``deepspeed`` compatibility distribution on ``PYTHONPATH``
(see ``conftest.py``). A tiny random Llama trains ``STEPS`` optimizer steps through the
Trainer with the variant's ds_config; a ``Trainer`` subclass records every micro-batch (the
inputs the model saw, the Trainer's ``num_items_in_batch`` and the loss). The reference
replays exactly those micro-batches through the same initial weights in plain PyTorch:
``torch.optim.AdamW`` (Trainer's decay/no-decay groups, or one group when the optimizer
comes from the ds_config), ``clip_grad_norm_`` and the same learning-rate schedule, written
here from DeepSpeed's documented ``WarmupDecayLR`` formula. Then a fresh Trainer resumes
from ``checkpoint-RESUME_AT`` and its losses are recorded for the remaining steps.

Variants: ``z{2,3}_trainer_opt`` (Trainer's own AdamW + linear schedule) and
``z{2,3}_ds_opt`` (``optimizer``/``scheduler`` in the ds_config, every value ``"auto"``).
Under ``shardspeed --nproc N`` rank r > 0 writes ``result_rank{r}.json``; the records of
all ranks are all-gathered and the reference replays every rank's micro-batches per step
(gradients summed, divided by N, as data parallelism does).
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path
from typing import Any

import torch
from tiny_models import tiny_llama, token_rows
from transformers import LlamaForCausalLM, Trainer, TrainingArguments
from transformers.optimization import get_linear_schedule_with_warmup

SAMPLES, SEQ, VOCAB = 12, 16, 64
BATCH, GAS, STEPS, RESUME_AT, WARMUP = 2, 2, 4, 2, 2
LR, WEIGHT_DECAY, BETAS, EPS, MAX_NORM = 3e-3, 0.01, (0.9, 0.98), 1e-7, 0.5


def build_model() -> LlamaForCausalLM:
    return tiny_llama(1234, SEQ, VOCAB)


def dataset() -> list[dict[str, torch.Tensor]]:
    return token_rows(99, SAMPLES, SEQ, VOCAB)


def ds_config(stage: int, ds_optimizer: bool) -> dict[str, Any]:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {"stage": stage, "reduce_bucket_size": "auto"},
    }
    if stage == 3:
        config["zero_optimization"].update(
            {
                "stage3_param_persistence_threshold": "auto",
                "stage3_prefetch_bucket_size": "auto",
                "stage3_gather_16bit_weights_on_model_save": True,
            }
        )
    if ds_optimizer:
        config["optimizer"] = {
            "type": "AdamW",
            "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
        }
        config["scheduler"] = {
            "type": "WarmupDecayLR",
            "params": {
                "warmup_min_lr": "auto",
                "warmup_max_lr": "auto",
                "warmup_num_steps": "auto",
                "total_num_steps": "auto",
            },
        }
    return config


class RecordingTrainer(Trainer):
    """Records each micro-batch the model sees and the loss the Trainer back-propagates."""

    records: list[dict[str, Any]]

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):  # type: ignore[override]
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        self.records.append(
            {
                "input_ids": inputs["input_ids"].detach().cpu().tolist(),
                "labels": inputs["labels"].detach().cpu().tolist(),
                "n": None if num_items_in_batch is None else int(num_items_in_batch),
                "scale": self.accelerator.num_processes
                if self.args.average_tokens_across_devices and num_items_in_batch is not None
                else 1,
                "step": self.state.global_step,
                "loss": float(loss.detach()),
            }
        )
        return loss


def train(out: Path, stage: int, ds_optimizer: bool, resume: str | None = None) -> RecordingTrainer:
    args = TrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=GAS,
        max_steps=STEPS,
        learning_rate=LR,
        weight_decay=WEIGHT_DECAY,
        adam_beta1=BETAS[0],
        adam_beta2=BETAS[1],
        adam_epsilon=EPS,
        max_grad_norm=MAX_NORM,
        warmup_steps=WARMUP,
        deepspeed=ds_config(stage, ds_optimizer),
        use_cpu=True,
        report_to=[],
        save_steps=RESUME_AT,
        save_strategy="steps",
        logging_steps=1,
        dataloader_num_workers=0,
        seed=7,
        disable_tqdm=True,
    )
    trainer = RecordingTrainer(model=build_model(), args=args, train_dataset=dataset())
    trainer.records = []
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def warmup_decay_factor(step: int) -> float:
    """Learning rate of optimizer step ``step`` (0-based) over ``max_lr``, from DeepSpeed's
    documented ``WarmupDecayLR``: the first step runs at ``warmup_min_lr`` (0 here), then the
    scheduler's iteration ``i = step - 1`` gives a log warm-up ``log(i + 1) / log(W)`` for
    ``i < W`` and a linear decay ``(T - i) / (T - W)`` (floored at 0) after it."""
    if step == 0:
        return 0.0
    i = step - 1
    if i < WARMUP:
        return math.log(i + 1) / math.log(WARMUP)
    return max(0.0, (STEPS - i) / max(1.0, STEPS - WARMUP))


def reference(by_rank: list[list[dict[str, Any]]], ds_optimizer: bool) -> list[list[float]]:
    """Plain PyTorch: the recorded micro-batches of every rank, step by step, through the same
    initial model. A step sums each rank's gradients (each rank's loss as the Trainer scaled
    it) and divides by the number of ranks, as data parallelism does; one rank: GAS summed
    micro-batch gradients."""
    world = len(by_rank)
    model = build_model()
    model.train()
    if ds_optimizer:  # the ds_config optimizer decays every parameter
        groups: list[dict[str, Any]] = [{"params": list(model.parameters())}]
        wd = WEIGHT_DECAY
    else:
        decay = set(Trainer.get_decay_parameter_names(None, model))  # type: ignore[arg-type]
        named = list(model.named_parameters())
        groups = [
            {"params": [p for n, p in named if n in decay], "weight_decay": WEIGHT_DECAY},
            {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
        ]
        wd = 0.0
    opt = torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS, weight_decay=wd)
    if ds_optimizer:
        sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_decay_factor)
    else:
        sched = get_linear_schedule_with_warmup(opt, WARMUP, STEPS)
    losses: list[list[float]] = [[] for _ in by_rank]
    for step in sorted({r["step"] for records in by_rank for r in records}):
        for rank, records in enumerate(by_rank):
            window = [r for r in records if r["step"] == step]
            for record in window:
                kwargs = {} if record["n"] is None else {"num_items_in_batch": record["n"]}
                ids, labels = torch.tensor(record["input_ids"]), torch.tensor(record["labels"])
                out = model(input_ids=ids, labels=labels, **kwargs)
                loss = out.loss * record["scale"]
                (loss if record["n"] is not None else loss / len(window)).backward()
                losses[rank].append(float(loss.detach()))
        for p in model.parameters():
            p.grad.div_(world)
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        sched.step()
        opt.zero_grad()
    return losses


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("variant")
    parser.add_argument("--no-resume", action="store_true")
    parser.add_argument("--local_rank", type=int, default=-1)  # the launcher passes it
    args = parser.parse_args()
    stage = int(args.variant[1])
    ds_optimizer = args.variant.endswith("ds_opt")
    run_dir = args.out / "run"
    trainer = train(run_dir, stage, ds_optimizer)
    result: dict[str, Any] = {
        "engine": type(trainer.model_wrapped).__name__,
        "world_size": int(os.environ.get("WORLD_SIZE", "1")),
        "losses": [r["loss"] for r in trainer.records],
        "batches": [r["input_ids"] for r in trainer.records],
        "lr": [entry["learning_rate"] for entry in trainer.state.log_history if "loss" in entry],
    }
    by_rank = [trainer.records]
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        by_rank = [[] for _ in range(torch.distributed.get_world_size())]
        torch.distributed.all_gather_object(by_rank, trainer.records)
        engine = trainer.model_wrapped
        result["dp_world_size"] = engine.dp_world_size
        result["accelerate_num_processes"] = trainer.accelerator.num_processes
    result["reference"] = reference(by_rank, ds_optimizer)[int(os.environ.get("RANK", "0"))]
    if not args.no_resume:
        checkpoint = run_dir / f"checkpoint-{RESUME_AT}"
        result["checkpoint_files"] = sorted(
            str(p.relative_to(checkpoint)) for p in checkpoint.rglob("*") if p.is_file()
        )
        resumed = train(args.out / "resumed", stage, ds_optimizer, resume=str(checkpoint))
        result["resumed_losses"] = [r["loss"] for r in resumed.records]
        result["resumed_batches"] = [r["input_ids"] for r in resumed.records]
    rank = int(os.environ.get("RANK", "0"))
    name = "result.json" if rank == 0 else f"result_rank{rank}.json"
    (args.out / name).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
