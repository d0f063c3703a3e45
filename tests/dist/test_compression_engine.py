"""``compression_training`` through the engine: the golden script of
``tests/unit/test_compression_golden.py`` with ``shardspeed.initialize`` driving the
compression scheduler (``engine.forward`` / ``engine.step``) instead of the test's stepper.

At ZeRO 0, 1 and 2 (fp32, one rank) the engine must give DeepSpeed 0.19.6's recorded losses
and kept heads and rows (rtol 1e-5), with the same global-RNG draws; ZeRO 3 is refused with
the fix. (Found by this test: the bit schedule used to replace ``weight.data``, which cut the
weight off the engine's flat buffer, so later updates never reached the model.)
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from shardspeed.testing import run_distributed

UNIT = Path(__file__).resolve().parents[1] / "unit"


def _golden_module():
    sys.path.insert(0, str(UNIT))
    import test_compression_golden as golden

    return golden


def _engine_script(stage: int) -> dict:
    import shardspeed
    from shardspeed.compression.compress import init_compression

    golden = _golden_module()
    torch.manual_seed(0)
    model = init_compression(golden.TinyBert(), golden.CONFIG)
    rng_probe = torch.rand(1).item()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    config = {
        **copy.deepcopy(golden.CONFIG),
        "train_micro_batch_size_per_gpu": 8,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": stage},
    }
    engine, _, _, _ = shardspeed.initialize(model=model, optimizer=optimizer, config=config)
    data = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 32, (golden.NUM_STEPS, 8, 6), generator=data)
    labels = torch.randint(0, 3, (golden.NUM_STEPS, 8), generator=data)
    losses = []
    for step in range(golden.NUM_STEPS):
        loss = nn.functional.cross_entropy(engine(tokens[step]), labels[step])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    module = engine.module
    heads, rows = {}, {}
    for i in range(2):
        out = module.get_submodule(f"encoder.layer.{i}.attention.output.dense")
        heads[f"encoder.layer.{i}"] = golden._kept(golden._topk(out.head_pruning_scores.data, 0.5))
        inter = module.get_submodule(f"encoder.layer.{i}.intermediate.dense")
        rows[f"encoder.layer.{i}"] = golden._kept(golden._topk(inter.row_mask_scores.data, 0.5))
    engine.destroy()
    return {"rng_probe": rng_probe, "losses": losses, "head_kept": heads, "row_kept": rows}


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_engine_steps_compression_as_deepspeed(stage: int) -> None:
    golden = json.loads(
        (UNIT.parent / "goldens" / "compression" / "deepspeed_0196.json").read_text()
    )
    result = run_distributed(_engine_script, 1, stage)[0]
    assert result["rng_probe"] == golden["rng_probe"]
    torch.testing.assert_close(result["losses"], golden["losses"], rtol=1e-5, atol=1e-6)
    assert result["head_kept"] == golden["head_kept"]
    assert result["row_kept"] == golden["row_kept"]


def test_compression_at_zero_3_is_refused() -> None:
    with pytest.raises(Exception, match="compression_training"):
        run_distributed(_engine_script, 1, 3)
