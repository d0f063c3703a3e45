"""Worker: ``from_pretrained`` under ZeRO-3 (``HfDeepSpeedConfig``) on shardspeed, 2 ranks.

    shardspeed --nproc 2 zero3_from_pretrained_worker.py OUT_DIR

Runs with the ``deepspeed`` compatibility distribution on ``PYTHONPATH`` (``conftest.py``).
Rank 0 saves a tiny random Llama with ``save_pretrained``; every rank then keeps an
``HfDeepSpeedConfig`` (stage 3) alive, so transformers builds the model inside
``deepspeed.zero.Init`` and loads the checkpoint into the partitions a few parameters at a time
through ``deepspeed.zero.GatheredParameters(..., modifier_rank=0)``. Recorded: each
parameter's partition size, the most parameters ever gathered at once while loading, and
whether the gathered weights equal the saved ones. Then ``deepspeed.initialize`` trains 4
steps (each rank its own micro-batch) and every rank also runs the plain PyTorch reference:
the saved weights, ``torch.optim.AdamW`` (the ds_config's ``AdamW``), each rank's gradient
summed and divided by 2, clipped at norm 1.0 (the ds_config's ``gradient_clipping``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path
from typing import Any

import deepspeed
import tiny_models
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, LlamaForCausalLM
from transformers.integrations import HfDeepSpeedConfig, is_deepspeed_zero3_enabled

SEQ, VOCAB, MICRO, STEPS, LR, MAX_NORM = 16, 64, 2, 4, 3e-3, 1.0


def tiny_llama() -> LlamaForCausalLM:
    return tiny_models.tiny_llama(2024, SEQ, VOCAB)


class CountingGather:
    """Wraps ``deepspeed.zero.GatheredParameters``: the most parameters gathered at once."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.live, self.peak = inner, 0, 0

    def __call__(self, params: Any, *args: Any, **kwargs: Any) -> Any:
        context = self.inner(params, *args, **kwargs)
        count = len(params) if isinstance(params, list | tuple) else 1
        outer = self

        class _Counted:
            def __enter__(self) -> Any:
                outer.live += count
                outer.peak = max(outer.peak, outer.live)
                return context.__enter__()

            def __exit__(self, *exc: Any) -> Any:
                outer.live -= count
                return context.__exit__(*exc)

        return _Counted()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--local_rank", type=int, default=-1)  # the launcher passes it
    args = parser.parse_args()
    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    path = args.out / "tiny-llama"
    if rank == 0:
        tiny_llama().save_pretrained(path)
    dist.barrier()
    saved = AutoModelForCausalLM.from_pretrained(path).state_dict()  # plain, for comparison

    ds_config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": MAX_NORM,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    keep_alive = HfDeepSpeedConfig(ds_config)  # transformers reads it through a weakref
    assert is_deepspeed_zero3_enabled()
    counter = CountingGather(deepspeed.zero.GatheredParameters)
    deepspeed.zero.GatheredParameters = counter
    try:
        model = AutoModelForCausalLM.from_pretrained(path)
    finally:
        deepspeed.zero.GatheredParameters = counter.inner
    params = dict(model.named_parameters())
    partitions = {
        name: [
            int(p.numel()),
            int(getattr(p, "ds_numel", -1)),
            int(p.ds_tensor.numel()) if hasattr(p, "ds_tensor") else -1,
        ]
        for name, p in params.items()
    }
    with deepspeed.zero.GatheredParameters(list(params.values())):
        loaded_equal = all(torch.equal(params[name], saved[name]) for name in params)

    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=ds_config
    )
    gen = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, VOCAB, (world, MICRO, SEQ), generator=gen) for _ in range(STEPS)]
    losses = []
    for batch in batches:
        ids = batch[rank]
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))

    ref_model = LlamaForCausalLM(tiny_llama().config)
    ref_model.load_state_dict(saved)
    opt = torch.optim.AdamW(ref_model.parameters(), lr=LR, weight_decay=0.01)
    ref_losses = []
    for batch in batches:
        per_rank = []
        for r in range(world):  # each rank's gradient, summed, then averaged (data parallel)
            per_rank.append(ref_model(input_ids=batch[r], labels=batch[r]).loss)
            per_rank[-1].backward()
        for p in ref_model.parameters():
            p.grad.div_(world)
        torch.nn.utils.clip_grad_norm_(ref_model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad()
        ref_losses.append(float(per_rank[rank].detach()))

    result = {
        "world": world,
        "zero3_enabled": True,
        "partitions": partitions,
        "expected_piece": {n: math.ceil(v[1] / world) for n, v in partitions.items()},
        "peak_gathered": counter.peak,
        "num_params": len(params),
        "loaded_equal": loaded_equal,
        "losses": losses,
        "ref_losses": ref_losses,
        "stage": engine.zero_optimization_stage(),
    }
    name = "result.json" if rank == 0 else f"result_rank{rank}.json"
    (args.out / name).write_text(json.dumps(result))
    del keep_alive


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
