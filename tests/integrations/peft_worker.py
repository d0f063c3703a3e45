"""Worker: a PEFT LoRA model through the Hugging Face ``Trainer(deepspeed=ds_config)``.

    python peft_worker.py OUT_DIR VARIANT        # VARIANT: lora_z2, lora_z3

Runs under ``shardspeed --nproc 2`` with the ``deepspeed`` compatibility distribution on
``PYTHONPATH`` (or with the real DeepSpeed of ``.venv-peers``, to record goldens). A tiny
random Llama wrapped by ``peft.get_peft_model`` (LoRA r=4 on ``q_proj``/``v_proj``): only the
adapters train, so the Trainer's no-decay parameter group is empty. Checked here and in
``test_peft.py``: the per-micro-batch losses against the plain PyTorch replay
(``framework_parity.replay``); ``trainer.save_model`` (``PeftModel.save_pretrained``, at
ZeRO-3 through ``_zero3_consolidated_16bit_state_dict(exclude_frozen_parameters=True)``)
writes full, unsharded adapter tensors; ``PeftModel.from_pretrained`` on a fresh base model
reproduces the trained engine's logits.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import torch
from framework_parity import (
    RecordingMixin,
    ds_config,
    gather_records,
    rank,
    replay,
    tensors,
    write_result,
)
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file
from tiny_models import tiny_llama, token_rows
from transformers import Trainer, TrainingArguments

SEQ, VOCAB, SAMPLES = 16, 64, 16
BATCH, GAS, STEPS, WARMUP = 2, 2, 4, 0
LR, WEIGHT_DECAY, BETAS, EPS, MAX_NORM = 5e-2, 0.01, (0.9, 0.98), 1e-7, 0.5


class RecordingTrainer(RecordingMixin, Trainer):
    pass


def base_model() -> torch.nn.Module:
    return tiny_llama(1234, SEQ, VOCAB)


def lora_model() -> torch.nn.Module:
    """The base model with fresh LoRA adapters (``lora_A`` seeded, ``lora_B`` zero)."""
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    model = base_model()
    torch.manual_seed(4321)
    return get_peft_model(model, config)


def train(out: Path, stage: int) -> RecordingTrainer:
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
        deepspeed=ds_config(stage),
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        dataloader_num_workers=0,
        seed=7,
        disable_tqdm=True,
    )
    rows = token_rows(99, SAMPLES, SEQ, VOCAB)
    trainer = RecordingTrainer(model=lora_model(), args=args, train_dataset=rows)
    trainer.records = []
    trainer.train()
    return trainer


def lm_loss(model: torch.nn.Module, record: dict[str, Any]) -> torch.Tensor:
    ids, labels = tensors(record, "input_ids", "labels")
    out = model(input_ids=ids, labels=labels, num_items_in_batch=record["n"])
    return out.loss * record["scale"]


def probe_ids() -> torch.Tensor:
    return torch.arange(2 * SEQ).remainder(VOCAB).view(2, SEQ)  # (2, SEQ)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("variant", choices=["lora_z2", "lora_z3"])
    parser.add_argument("--local_rank", type=int, default=-1)  # the launcher passes it
    args = parser.parse_args()
    stage = int(args.variant[-1])
    trainer = train(args.out / "run", stage)
    reference_model = lora_model()
    reference = replay(
        gather_records(trainer.records),
        reference_model,
        lm_loss,
        lr=LR,
        betas=BETAS,
        eps=EPS,
        weight_decay=WEIGHT_DECAY,
        max_norm=MAX_NORM,
        warmup=WARMUP,
        steps=STEPS,
    )
    num_groups = len(trainer.optimizer.param_groups)
    group_sizes = [len(group["params"]) for group in trainer.optimizer.param_groups]

    adapter_dir = args.out / "adapter"
    trainer.save_model(str(adapter_dir))  # every rank: the ZeRO-3 gather is collective
    engine = trainer.model_wrapped
    engine.eval()
    with torch.no_grad():  # the engine's forward (ZeRO-3 gathers the partitions)
        trained_logits = engine(input_ids=probe_ids()).logits.float()  # (2, SEQ, VOCAB)
    result: dict[str, Any] = {
        "engine": type(engine).__name__,
        "world_size": int(os.environ.get("WORLD_SIZE", "1")),
        "accelerate_num_processes": trainer.accelerator.num_processes,
        "optimizer_group_sizes": group_sizes,
        "num_optimizer_groups": num_groups,
        "losses": [r["loss"] for r in trainer.records],
        "steps": [r["step"] for r in trainer.records],
        "reference": reference[rank()],
    }
    if rank() == 0:
        saved = load_file(str(adapter_dir / "adapter_model.safetensors"))
        expected = {
            name: tuple(p.shape)
            for name, p in reference_model.named_parameters()
            if p.requires_grad
        }
        result["saved_shapes"] = {name: list(t.shape) for name, t in saved.items()}
        result["expected_shapes"] = {name: list(shape) for name, shape in expected.items()}
        reloaded = PeftModel.from_pretrained(base_model(), str(adapter_dir)).eval()
        with torch.no_grad():
            reloaded_logits = reloaded(input_ids=probe_ids()).logits.float()
            reference_logits = reference_model.eval()(input_ids=probe_ids()).logits.float()
        result["reload_max_abs_diff"] = float((reloaded_logits - trained_logits).abs().max())
        result["reload_max_abs_logit"] = float(trained_logits.abs().max())
        result["reference_logits_max_abs_diff"] = float(
            (reference_logits - trained_logits).abs().max()
        )
    write_result(args.out, result)


if __name__ == "__main__":
    main()
