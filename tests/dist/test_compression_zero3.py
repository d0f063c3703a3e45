"""``compression_training`` under ZeRO stage 3 on 2 ranks against one process.

The golden script's model (``tests/unit/test_compression_golden.py``: a 2-layer BERT-like
encoder) with weight quantization in forward (6 -> 4 bits, period 1, 2 groups), sparse
pruning (l1), head pruning (topk, q/k/v related), row pruning (topk, next layer related)
and dynamic 8-bit activation quantization, trained 5 SGD steps by a stage-3 engine on 2
gloo ranks (each rank half of the global batch of 8), then ``redundancy_clean(engine)``.
The reference is the same script in one process with plain PyTorch driving the
compression hook. Equal: the loss of every step (rtol 1e-5), the kept heads and rows, and
the cleaned state dict (shapes and values) and logits on every rank.

SGD with momentum, not Adam: the key projections' biases get a zero gradient in exact
arithmetic (softmax is shift-invariant per query), and Adam would turn the rounding noise in
it (different summation orders on 1 and 2 ranks) into full-size steps.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardspeed.testing import run_distributed

UNIT = Path(__file__).resolve().parents[1] / "unit"
NUM_STEPS = 5  # row pruning (the last technique) switches on for the 5th forward
GLOBAL_BATCH = 8


def _golden():
    sys.path.insert(0, str(UNIT))
    import test_compression_golden as golden

    return golden


def _config() -> dict[str, Any]:
    golden = _golden()
    cfg = copy.deepcopy(golden.CONFIG)
    block = cfg["compression_training"]
    wq = block["weight_quantization"]
    wq["shared_parameters"]["quantize_weight_in_forward"] = True
    wq["different_groups"]["wq1"]["params"].update(start_bits=6, quantization_period=1)
    block["activation_quantization"] = {
        "shared_parameters": {
            "enabled": True,
            "schedule_offset": 1,
            "quantization_type": "symmetric",
            "range_calibration": "dynamic",
        },
        "different_groups": {"aq1": {"params": {"bits": 8}, "modules": ["intermediate"]}},
    }
    return cfg


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 32, (NUM_STEPS, GLOBAL_BATCH, 6), generator=gen)
    labels = torch.randint(0, 3, (NUM_STEPS, GLOBAL_BATCH), generator=gen)
    return tokens, labels


def _kept(model: nn.Module) -> dict[str, list[int]]:
    golden = _golden()
    out = {}
    for i in range(2):
        dense = model.get_submodule(f"encoder.layer.{i}.attention.output.dense")
        out[f"heads{i}"] = golden._kept(golden._topk(dense.head_pruning_scores.data, 0.5))
        inter = model.get_submodule(f"encoder.layer.{i}.intermediate.dense")
        out[f"rows{i}"] = golden._kept(golden._topk(inter.row_mask_scores.data, 0.5))
    return out


def _finish(model: nn.Module, tokens: torch.Tensor) -> dict[str, Any]:
    model.eval()
    with torch.no_grad():
        logits = model(tokens[0])
    return {
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "logits": logits,
        "num_params": sum(p.numel() for p in model.parameters()),
    }


def _reference() -> dict[str, Any]:
    from shardspeed.compression import build_compression_hook, init_compression, redundancy_clean

    golden, config = _golden(), _config()
    torch.manual_seed(0)
    model = init_compression(golden.TinyBert(), config)
    hook = build_compression_hook(model, config)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    tokens, labels = _data()
    losses = []
    for step in range(NUM_STEPS):
        hook.before_forward(step)
        loss = nn.functional.cross_entropy(model(tokens[step]), labels[step])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        hook.after_optimizer_step(True)
        losses.append(loss.item())
    kept = _kept(model)
    model = redundancy_clean(model, config)
    return {"losses": losses, "kept": kept, **_finish(model, tokens)}


def _zero3_script() -> dict[str, Any]:
    import shardspeed
    from shardspeed.compression import init_compression, redundancy_clean

    golden, config = _golden(), _config()
    rank, world = dist.get_rank(), dist.get_world_size()
    micro = GLOBAL_BATCH // world
    torch.manual_seed(0)
    model = init_compression(golden.TinyBert(), config)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ds_config = {
        **config,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": 3},
    }
    engine, _, _, _ = shardspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    tokens, labels = _data()
    losses = []
    for step in range(NUM_STEPS):
        rows = slice(rank * micro, (rank + 1) * micro)
        loss = nn.functional.cross_entropy(engine(tokens[step, rows]), labels[step, rows])
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    with torch.no_grad():  # the scores are stage-3 shards outside forward: gather to read them
        from shardspeed.zero.init import GatheredParameters

        with GatheredParameters(list(engine.module.parameters())):
            kept = _kept(engine.module)
    cleaned = redundancy_clean(engine, config)
    assert cleaned is engine.module and isinstance(cleaned, golden.TinyBert)
    return {"losses": losses, "kept": kept, **_finish(cleaned, tokens)}


def test_zero3_compression_matches_one_process():
    reference = _reference()
    for result in run_distributed(_zero3_script, 2):
        torch.testing.assert_close(result["losses"], reference["losses"], rtol=1e-5, atol=1e-6)
        assert result["kept"] == reference["kept"]
        assert result["num_params"] == reference["num_params"]
        assert result["state"].keys() == reference["state"].keys()
        for name, value in reference["state"].items():
            torch.testing.assert_close(
                result["state"][name],
                value,
                rtol=1e-5,
                atol=1e-6,
                msg=lambda m, n=name: f"{n}: {m}",
            )
        torch.testing.assert_close(result["logits"], reference["logits"], rtol=1e-5, atol=1e-6)
