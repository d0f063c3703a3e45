"""Worker: TRL ``SFTTrainer`` / ``DPOTrainer`` with ``deepspeed=ds_config`` vs plain PyTorch.

    python trl_worker.py OUT_DIR VARIANT        # VARIANT: sft_z2, sft_z3, dpo_z2, dpo_z3

Runs under ``shardspeed --nproc 2`` with the ``deepspeed`` compatibility distribution on
``PYTHONPATH`` (or, to record goldens, with the real DeepSpeed of ``.venv-peers``). A tiny
random Llama and a word-level tokenizer built in memory (``tiny_models.py``); text data the
trainer tokenizes itself. TRL's own defaults stay where they shape the run (SFT: gradient
checkpointing on, padding to the longest row, token-averaged loss; DPO: sigmoid loss,
beta 0.1, a reference model that TRL wraps with ``deepspeed.initialize``: stage 0 under
ZeRO-2, stage 3 with TRL's dotted ``zero_optimization.*`` keys under ZeRO-3).

The reference (``framework_parity.replay``) recomputes each recorded micro-batch's loss in
plain PyTorch: SFT as the model's own causal-LM loss over ``num_items_in_batch`` tokens,
DPO as ``-logsigmoid(beta * (chosen - ref_chosen - (rejected - ref_rejected)))`` from
token log-probabilities summed over the completion, the reference model frozen at the
initial weights.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from datasets import Dataset
from datasets.table import InMemoryTable
from framework_parity import (
    RecordingMixin,
    ds_config,
    gather_records,
    rank,
    replay,
    tensors,
    write_result,
)
from tiny_models import tiny_llama, tiny_tokenizer, word_text
from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer

SEQ, VOCAB, SAMPLES = 32, 64, 16
BATCH, GAS, STEPS, WARMUP = 2, 2, 4, 0
LR, WEIGHT_DECAY, BETAS, EPS, MAX_NORM = 3e-3, 0.01, (0.9, 0.98), 1e-7, 0.5
DPO_BETA = 0.1


class RecordingSFT(RecordingMixin, SFTTrainer):
    pass


class RecordingDPO(RecordingMixin, DPOTrainer):
    pass


def build_model() -> torch.nn.Module:
    return tiny_llama(1234, SEQ, VOCAB)


def rows_dataset(rows: dict[str, list[str]], fingerprint: str) -> Dataset:
    """``Dataset.from_dict`` with a fingerprint given, not hashed (hashing can fail to pickle)."""
    return Dataset(InMemoryTable.from_pydict(rows), fingerprint=fingerprint)


def sft_data() -> Dataset:
    gen = torch.Generator().manual_seed(5)
    lengths = torch.randint(4, 14, (SAMPLES,), generator=gen).tolist()
    rows = {"text": [word_text(gen, n) for n in lengths]}
    return rows_dataset(rows, "trl-sft-rows")


def dpo_data() -> Dataset:
    gen = torch.Generator().manual_seed(6)
    rows: dict[str, list[str]] = {"prompt": [], "chosen": [], "rejected": []}
    for _ in range(SAMPLES):
        num_prompt, num_chosen, num_rejected = torch.randint(2, 7, (3,), generator=gen).tolist()
        rows["prompt"].append(word_text(gen, num_prompt))
        rows["chosen"].append(" " + word_text(gen, num_chosen))
        rows["rejected"].append(" " + word_text(gen, num_rejected))
    return rows_dataset(rows, "trl-dpo-rows")


def common_args(out: Path, stage: int) -> dict[str, Any]:
    return {
        "output_dir": str(out),
        "per_device_train_batch_size": BATCH,
        "gradient_accumulation_steps": GAS,
        "max_steps": STEPS,
        "learning_rate": LR,
        "weight_decay": WEIGHT_DECAY,
        "adam_beta1": BETAS[0],
        "adam_beta2": BETAS[1],
        "adam_epsilon": EPS,
        "max_grad_norm": MAX_NORM,
        "warmup_steps": WARMUP,
        "deepspeed": ds_config(stage),
        "use_cpu": True,
        "bf16": False,
        "report_to": [],
        "save_strategy": "no",
        "logging_steps": 1,
        "dataloader_num_workers": 0,
        "seed": 7,
        "disable_tqdm": True,
    }


def train_sft(out: Path, stage: int) -> RecordingSFT:
    args = SFTConfig(**common_args(out, stage), max_length=SEQ)  # TRL default: checkpointing on
    trainer = RecordingSFT(
        model=build_model(), args=args, train_dataset=sft_data(), processing_class=tiny_tokenizer()
    )
    trainer.records = []
    trainer.train()
    return trainer


def train_dpo(out: Path, stage: int) -> RecordingDPO:
    args = DPOConfig(**common_args(out, stage), beta=DPO_BETA, max_length=SEQ)
    trainer = RecordingDPO(
        model=build_model(),
        ref_model=build_model(),
        args=args,
        train_dataset=dpo_data(),
        processing_class=tiny_tokenizer(),
    )
    trainer.records = []
    trainer.train()
    return trainer


def sft_loss(model: torch.nn.Module, record: dict[str, Any]) -> torch.Tensor:
    ids, mask, labels = tensors(record, "input_ids", "attention_mask", "labels")
    out = model(input_ids=ids, attention_mask=mask, labels=labels, num_items_in_batch=record["n"])
    return out.loss * record["scale"]


def completion_logps(model: torch.nn.Module, record: dict[str, Any]) -> torch.Tensor:
    """Sum of the completion tokens' log-probabilities, one per row (chosen rows, then rejected)."""
    ids, mask, completion = tensors(record, "input_ids", "attention_mask", "completion_mask")
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits[
        :, :-1
    ]  # (2B, T-1, V)
    token_logps = F.log_softmax(logits.float(), dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return (token_logps * completion[:, 1:]).sum(dim=1)  # (2B,)


def dpo_loss_fn(ref_model: torch.nn.Module):  # type: ignore[no-untyped-def]
    def loss_of(model: torch.nn.Module, record: dict[str, Any]) -> torch.Tensor:
        chosen, rejected = completion_logps(model, record).chunk(2)
        with torch.no_grad():
            ref_chosen, ref_rejected = completion_logps(ref_model, record).chunk(2)
        delta = (chosen - ref_chosen) - (rejected - ref_rejected)
        return -F.logsigmoid(DPO_BETA * delta).mean()

    return loss_of


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("variant", choices=["sft_z2", "sft_z3", "dpo_z2", "dpo_z3"])
    parser.add_argument("--local_rank", type=int, default=-1)  # the launcher passes it
    args = parser.parse_args()
    kind, stage = args.variant.split("_z")[0], int(args.variant[-1])
    train = train_sft if kind == "sft" else train_dpo
    trainer = train(args.out / "run", stage)
    by_rank = gather_records(trainer.records)
    if kind == "sft":
        loss_of = sft_loss
    else:
        reference_model = build_model().eval()
        loss_of = dpo_loss_fn(reference_model)
    reference = replay(
        by_rank,
        build_model(),
        loss_of,
        lr=LR,
        betas=BETAS,
        eps=EPS,
        weight_decay=WEIGHT_DECAY,
        max_norm=MAX_NORM,
        warmup=WARMUP,
        steps=STEPS,
    )
    result = {
        "engine": type(trainer.model_wrapped).__name__,
        "world_size": int(os.environ.get("WORLD_SIZE", "1")),
        "accelerate_num_processes": trainer.accelerator.num_processes,
        "losses": [r["loss"] for r in trainer.records],
        "steps": [r["step"] for r in trainer.records],
        "reference": reference[rank()],
    }
    if kind == "dpo":
        result["ref_engine"] = type(trainer.ref_model).__name__
    write_result(args.out, result)


if __name__ == "__main__":
    main()
