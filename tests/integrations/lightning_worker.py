"""Worker: PyTorch Lightning's ``DeepSpeedStrategy`` (ZeRO 2 / 3) on 2 CPU ranks.

    python lightning_worker.py OUT_DIR VARIANT        # VARIANT: z2, z3

Runs under ``shardspeed --nproc 2`` with the ``deepspeed`` compatibility distribution on
``PYTHONPATH`` (or with the real DeepSpeed of ``.venv-peers``, to record goldens). Lightning
builds the ds_config itself (``DeepSpeedStrategy(stage=N)``: its default ZeRO block,
``gradient_accumulation_steps`` from ``accumulate_grad_batches``, ``gradient_clipping`` from
``gradient_clip_val``) and hands ``configure_optimizers``' ``torch.optim.AdamW`` to
``deepspeed.initialize``.

Without ``--resume-from``: 2 epochs (4 optimizer steps of 2 micro-batches on each rank); a
``ModelCheckpoint`` saves a DeepSpeed checkpoint directory after each epoch
(``checkpoints/epoch0.ckpt``, ``epoch1.ckpt``), and the ranks gather the final full weights
into ``weights.pt`` (what ``lightning_convert.py`` compares the fp32 conversion with). With
``--resume-from checkpoints/epoch0.ckpt``: a fresh Trainer resumes and trains epoch 1 again;
its losses must be the uninterrupted run's. ``--layout deepspeed``: the checkpoints are
saved in DeepSpeed's file layout (what Lightning's fp32 converter reads).

Lightning refuses DeepSpeed without CUDA ("only supported on CUDA GPUs"), for the real
DeepSpeed too, checks that CPU devices have GPU indices, and passes
``device_rank=root_device.index`` (``None`` on CPU): :class:`CPUDeepSpeedStrategy` skips
both checks and passes the local rank instead.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from framework_parity import rank, write_result
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DeepSpeedStrategy
from tiny_models import tiny_llama, token_rows

SEQ, VOCAB, SAMPLES = 16, 64, 16
BATCH, GAS, EPOCHS = 2, 2, 2
LR, WEIGHT_DECAY, BETAS, EPS, MAX_NORM = 3e-3, 0.01, (0.9, 0.98), 1e-7, 0.5


class CPUDeepSpeedStrategy(DeepSpeedStrategy):
    """``DeepSpeedStrategy`` without its CUDA-only checks, passing the local rank as device.

    ``layout="deepspeed"`` adds ``"checkpoint": {"layout": "deepspeed"}`` to the ds_config:
    shardspeed then saves DeepSpeed's on-disk files (``*_model_states.pt``,
    ``*_optim_states.pt``), which Lightning's fp32 converter reads; DeepSpeed ignores it."""

    def __init__(self, stage: int, layout: str | None = None) -> None:
        super().__init__(stage=stage)
        if layout is not None:
            assert isinstance(self.config, dict)
            self.config["checkpoint"] = {"layout": layout}

    def setup_environment(self) -> None:
        super(DeepSpeedStrategy, self).setup_environment()  # DDPStrategy's: no CUDA check

    def setup_distributed(self) -> None:  # as DeepSpeedStrategy's, without the GPU-index check
        reset_seed()
        self.set_world_ranks()
        self._init_deepspeed_distributed()

    def _setup_model_and_optimizer(self, model, optimizer, lr_scheduler=None):  # type: ignore[no-untyped-def]
        import deepspeed

        deepspeed_engine, deepspeed_optimizer, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=self.local_rank),
            config=self.config,
            model=model,
            model_parameters=filter(lambda p: p.requires_grad, model.parameters()),
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            dist_init_required=False,
        )
        return deepspeed_engine, deepspeed_optimizer


class TinyLM(pl.LightningModule):
    """The tiny Llama as a LightningModule; ``records`` gets one entry per micro-batch."""

    def __init__(self) -> None:
        super().__init__()
        self.model = tiny_llama(1234, SEQ, VOCAB)
        self.records: list[dict[str, Any]] = []

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=batch, labels=batch).loss
        engine = self.trainer.strategy.deepspeed_engine  # type: ignore[attr-defined]
        self.records.append(
            {
                "ids": batch.tolist(),
                "loss": float(loss.detach()),
                "epoch": self.current_epoch,
                "step": int(engine.global_steps),  # optimizer steps done before this micro-batch
            }
        )
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(
            self.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY
        )

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        rows = [row["input_ids"] for row in token_rows(99, SAMPLES, SEQ, VOCAB)]
        return torch.utils.data.DataLoader(rows, batch_size=BATCH, shuffle=True)


def trainer(
    out: Path, stage: int, callbacks: list[pl.Callback], layout: str | None = None
) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=int(os.environ.get("WORLD_SIZE", "1")),
        strategy=CPUDeepSpeedStrategy(stage, layout),
        max_epochs=EPOCHS,
        accumulate_grad_batches=GAS,
        gradient_clip_val=MAX_NORM,
        precision="32-true",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=bool(callbacks),
        callbacks=callbacks,
        default_root_dir=str(out),
    )


def gather_records(records: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    by_rank: list[list[dict[str, Any]]] = [[] for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather_object(by_rank, records)
    return by_rank


def reference(by_rank: list[list[dict[str, Any]]]) -> list[list[float]]:
    """Plain PyTorch over every rank's recorded micro-batches: per optimizer step each rank's
    ``loss / GAS**2`` back-propagated, gradients divided by the ranks, clipped, ``AdamW``.

    ``GAS**2``: Lightning divides the loss by ``accumulate_grad_batches`` before
    ``strategy.backward`` and DeepSpeed's ``engine.backward`` divides by
    ``gradient_accumulation_steps`` again (real DeepSpeed too). Adam would hide a constant
    factor, but clipping does not: which steps are clipped depends on it."""
    world = len(by_rank)
    model = tiny_llama(1234, SEQ, VOCAB)
    model.train()
    opt = torch.optim.AdamW(
        model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY
    )
    losses: list[list[float]] = [[] for _ in by_rank]
    for step in sorted({r["step"] for records in by_rank for r in records}):
        for index, records in enumerate(by_rank):
            for record in (r for r in records if r["step"] == step):
                ids = torch.tensor(record["ids"])
                loss = model(input_ids=ids, labels=ids).loss
                (loss / GAS / GAS).backward()
                losses[index].append(float(loss.detach()))
        for p in model.parameters():
            p.grad.div_(world)
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad()
    return losses


def full_weights(module: pl.LightningModule, stage: int) -> dict[str, torch.Tensor]:
    """The module's full fp32 weights (gathered from the ZeRO-3 partitions on every rank)."""
    import deepspeed

    params = list(module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=stage == 3):
        return {name: p.detach().clone().float() for name, p in module.named_parameters()}


def train(out: Path, stage: int, layout: str | None) -> dict[str, Any]:
    """2 epochs from scratch; ``ModelCheckpoint`` saves ``checkpoints/epoch{0,1}.ckpt``."""
    checkpoints = out / "checkpoints"
    saver = ModelCheckpoint(
        dirpath=checkpoints,
        filename="epoch{epoch}",
        auto_insert_metric_name=False,
        every_n_epochs=1,
        save_top_k=-1,
    )
    module = TinyLM()
    trainer(out / "run", stage, [saver], layout).fit(module)
    engine = module.trainer.strategy.deepspeed_engine  # type: ignore[attr-defined]
    weights = full_weights(module, stage)  # collective at ZeRO-3
    if rank() == 0:
        torch.save(weights, out / "weights.pt")
    return {
        "engine": type(engine).__name__,
        "zero_stage": int(engine.zero_optimization_stage()),
        "world_size": torch.distributed.get_world_size(),
        "losses": [r["loss"] for r in module.records],
        "steps": [r["step"] for r in module.records],
        "epochs": [r["epoch"] for r in module.records],
        "batches": [r["ids"] for r in module.records],
        "reference": reference(gather_records(module.records))[rank()],
        "checkpoint_files": sorted(
            str(p.relative_to(checkpoints)) for p in checkpoints.rglob("*") if p.is_file()
        ),
        "final_checkpoint": str(checkpoints / f"epoch{EPOCHS - 1}.ckpt"),
    }


def resume(out: Path, stage: int, checkpoint: Path) -> dict[str, Any]:
    """A fresh Trainer resumes from ``checkpoint`` (after epoch 0) and trains epoch 1."""
    module = TinyLM()
    trainer(out / "run", stage, []).fit(module, ckpt_path=str(checkpoint))
    return {
        "losses": [r["loss"] for r in module.records],
        "steps": [r["step"] for r in module.records],
        "batches": [r["ids"] for r in module.records],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("variant", choices=["z2", "z3"])
    parser.add_argument("--resume-from", type=Path, help="a checkpoint directory to resume")
    parser.add_argument("--layout", choices=["deepspeed"], help="the checkpoint layout to save")
    parser.add_argument("--local_rank", type=int, default=-1)  # the launcher passes it
    args = parser.parse_args()
    stage = int(args.variant[-1])
    pl.seed_everything(7, verbose=False)
    if args.resume_from is None:
        result = train(args.out, stage, args.layout)
    else:
        result = resume(args.out, stage, args.resume_from)
    write_result(args.out, result)


if __name__ == "__main__":
    main()
