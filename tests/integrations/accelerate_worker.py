"""Worker: Accelerate's ``DeepSpeedPlugin`` on shardspeed vs a plain PyTorch loop.

    python accelerate_worker.py OUT_DIR STAGE

Runs in a subprocess with the ``deepspeed`` compatibility distribution on ``PYTHONPATH``
(see ``conftest.py``). The documented Accelerate loop: ``Accelerator(deepspeed_plugin=
DeepSpeedPlugin(zero_stage=STAGE, gradient_accumulation_steps=2, gradient_clipping=...))``,
``prepare(model, optimizer, dataloader, scheduler)``, ``accumulate``, ``backward``,
``clip_grad_norm_`` (which, under DeepSpeed, reports the engine's global norm), ``step``.
After ``SAVE_AT`` steps ``save_state``; after ``STEPS`` steps ``get_state_dict`` (the full
weights; under ZeRO-3 the engine's consolidated 16-bit state dict); then ``load_state``
rewinds to ``SAVE_AT`` and the last steps run again on the same batches.

The reference is plain PyTorch over the recorded batches: the same initial weights,
``torch.optim.AdamW``, the same ``LambdaLR`` and ``clip_grad_norm_`` (whose return value
must equal ``clip_grad_norm_``'s under DeepSpeed).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator, DeepSpeedPlugin
from tiny_models import tiny_llama, token_rows
from torch.utils.data import DataLoader
from transformers import LlamaForCausalLM

SAMPLES, SEQ, VOCAB = 12, 16, 64
BATCH, GAS, STEPS, SAVE_AT = 2, 2, 4, 2
LR, MAX_NORM = 3e-3, 0.5


def build_model() -> LlamaForCausalLM:
    return tiny_llama(4321, SEQ, VOCAB)


def dataset() -> list[dict[str, torch.Tensor]]:
    return token_rows(17, SAMPLES, SEQ, VOCAB)


def schedule(step: int) -> float:
    """Linear warm-up over 2 steps, then linear decay to 0.25 at step ``STEPS``."""
    return min((step + 1) / 2, 1.0 - 0.75 * max(0, step - 1) / (STEPS - 1))


def make_optimizer(model: torch.nn.Module) -> tuple[torch.optim.Optimizer, Any]:
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, betas=(0.9, 0.95))
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, schedule)


def train_steps(
    accelerator: Accelerator, model: Any, opt: Any, sched: Any, batches: list[Any], steps: int
) -> tuple[list[float], list[float]]:
    """``steps`` optimizer steps over ``batches`` (GAS micro-batches each): losses, norms."""
    losses, norms = [], []
    for batch in batches[: steps * GAS]:
        with accelerator.accumulate(model):
            out = model(input_ids=batch["input_ids"], labels=batch["labels"])
            accelerator.backward(out.loss)
            losses.append(float(out.loss.detach()))
            if accelerator.sync_gradients:
                norm = accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)
                norms.append(float(norm))
            opt.step()
            sched.step()
            opt.zero_grad()
    return losses, norms


def reference(batches: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
    model = build_model()
    opt, sched = make_optimizer(model)
    losses, norms = [], []
    for index, batch in enumerate(batches):
        out = model(input_ids=batch["input_ids"], labels=batch["labels"])
        (out.loss / GAS).backward()
        losses.append(float(out.loss.detach()))
        if (index + 1) % GAS == 0:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
            opt.step()
            sched.step()
            opt.zero_grad()
    return {"losses": losses, "norms": norms, "state": model.state_dict()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("stage", type=int)
    args = parser.parse_args()
    plugin = DeepSpeedPlugin(
        zero_stage=args.stage,
        gradient_accumulation_steps=GAS,
        gradient_clipping=MAX_NORM,
        zero3_save_16bit_model=args.stage == 3,
    )
    accelerator = Accelerator(deepspeed_plugin=plugin)
    model = build_model()
    opt, sched = make_optimizer(model)
    loader = DataLoader(dataset(), batch_size=BATCH, shuffle=False)
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    batches = [b for b in loader]  # one epoch: 6 micro-batches
    batches = batches + batches[: STEPS * GAS - len(batches)]  # crosses into epoch 2

    first, norms_first = train_steps(accelerator, model, opt, sched, batches, SAVE_AT)
    accelerator.save_state(str(args.out / "state"))
    rest, norms_rest = train_steps(
        accelerator, model, opt, sched, batches[SAVE_AT * GAS :], STEPS - SAVE_AT
    )
    full = accelerator.get_state_dict(model)
    accelerator.load_state(str(args.out / "state"))
    again, norms_again = train_steps(
        accelerator, model, opt, sched, batches[SAVE_AT * GAS :], STEPS - SAVE_AT
    )

    ref = reference(batches)
    weight_err = max(
        float((full[name].float() - tensor).abs().max()) for name, tensor in ref["state"].items()
    )
    result = {
        "engine": type(model).__name__,
        "distributed_type": str(accelerator.distributed_type),
        "losses": first + rest,
        "norms": norms_first + norms_rest,
        "reloaded_losses": again,
        "reloaded_norms": norms_again,
        "ref_losses": ref["losses"],
        "ref_norms": ref["norms"],
        "state_keys_match": sorted(full) == sorted(ref["state"]),
        "weight_max_abs_err": weight_err,
        "state_files": sorted(
            str(p.relative_to(args.out / "state")) for p in (args.out / "state").rglob("*")
        ),
    }
    (args.out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
