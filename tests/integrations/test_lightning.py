"""PyTorch Lightning's ``DeepSpeedStrategy`` (ZeRO 2 and 3) on shardspeed, 2 CPU ranks.

``lightning_worker.py`` runs under ``shardspeed --nproc 2`` with the ``deepspeed``
compatibility distribution; Lightning writes the ds_config and calls
``deepspeed.initialize``, ``engine.backward/step``, ``save_checkpoint`` and
``load_checkpoint`` itself. A tiny random Llama trains 2 epochs (4 optimizer steps of 2
micro-batches per rank, clipping 0.5, ``AdamW`` from ``configure_optimizers``); a
``ModelCheckpoint`` saves a DeepSpeed checkpoint directory after each epoch.

One 2-rank training run per stage (a module-scoped fixture) feeds three tests:
``test_lightning_trains_like_plain_pytorch``: losses equal a plain PyTorch replay and
DeepSpeed 0.19.8's (``tests/goldens/frameworks/lightning_*.json``) within rtol 1e-5, atol
1e-6. ``test_lightning_resumes_from_its_checkpoint``: a second 2-rank run resumes from
``epoch0.ckpt`` and sees epoch 1's batches and losses again. ZeRO 3 runs in ``make test``,
ZeRO 2 in ``make test-slow`` (suite time).
``test_lightning_fp32_conversion``: the run's checkpoints hold DeepSpeed's
``*_optim_states.pt`` files too (``checkpoint.layout`` "auto" under the compatibility
distribution), and
``lightning.pytorch.utilities.deepspeed.convert_zero_checkpoint_to_fp32_state_dict`` on
``epoch1.ckpt`` must give the model's final weights exactly (``lightning_convert.py``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from framework_goldens import check_golden, close, needs_peers, record_or_compare


# Suite time: the ZeRO 2 run and its tests are in make test-slow; ZeRO 3 (the same strategy
# plumbing, with sharded parameters to gather, save and convert) stays in make test
@pytest.fixture(scope="module", params=[pytest.param("z2", marks=pytest.mark.slow), "z3"])
def lightning_run(
    request: pytest.FixtureRequest,
    run_worker: Callable[..., dict[str, Any]],
    launch: Callable[[int], list[str]],
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[str, Path, list[dict[str, Any]]]:
    """``(variant, out_dir, [rank 0 result, rank 1 result])`` of one 2-rank worker run."""
    pytest.importorskip("lightning")
    variant = request.param
    out = tmp_path_factory.mktemp(f"lightning_{variant}")
    rank0 = run_worker("lightning_worker.py", out, variant, launcher=launch(2))
    rank1 = json.loads((out / "result_rank1.json").read_text())
    return variant, out, [rank0, rank1]


def test_lightning_trains_like_plain_pytorch(lightning_run: tuple[str, Path, list[dict]]) -> None:
    variant, _, results = lightning_run
    for result in results:
        assert result["engine"] == "ShardSpeedEngine"
        assert result["zero_stage"] == int(variant[-1]) and result["world_size"] == 2
        # 16 rows / 2 ranks / 2 per micro-batch = 4 micro-batches an epoch: 2 steps of 2
        assert result["steps"] == [0, 0, 1, 1, 2, 2, 3, 3]
        assert result["epochs"] == [0, 0, 0, 0, 1, 1, 1, 1]
        close(result["losses"], result["reference"])
        files = result["checkpoint_files"]
        assert any(name.startswith("epoch0.ckpt/") for name in files), files
    assert results[0]["batches"][:4] != results[1]["batches"][:4]  # a distributed sampler
    check_golden(f"lightning_{variant}", results)


# Suite time: the resume at ZeRO 2 runs in make test-slow; ZeRO 3 (the same Lightning resume
# path, with sharded parameters to load back) stays in make test
@pytest.mark.parametrize(
    "lightning_run", [pytest.param("z2", marks=pytest.mark.slow), "z3"], indirect=True
)
def test_lightning_resumes_from_its_checkpoint(
    lightning_run: tuple[str, Path, list[dict]],
    run_worker: Callable[..., dict[str, Any]],
    launch: Callable[[int], list[str]],
    tmp_path: Path,
) -> None:
    variant, out, results = lightning_run
    checkpoint = str(out / "checkpoints" / "epoch0.ckpt")
    args = (variant, "--resume-from", checkpoint)
    rank0 = run_worker("lightning_worker.py", tmp_path, *args, launcher=launch(2))
    rank1 = json.loads((tmp_path / "result_rank1.json").read_text())
    for resumed, uninterrupted in zip((rank0, rank1), results, strict=True):
        assert resumed["steps"] == [2, 2, 3, 3]  # the engine's step count came back
        assert resumed["batches"] == uninterrupted["batches"][4:]  # epoch 1's order
        close(resumed["losses"], uninterrupted["losses"][4:])


def test_lightning_fp32_conversion(
    lightning_run: tuple[str, Path, list[dict]],
    run_worker: Callable[..., dict[str, Any]],
    tmp_path: Path,
) -> None:
    """Lightning's converter on the unchanged run's last checkpoint: under the compatibility
    distribution the default ``checkpoint.layout`` ("auto") writes DeepSpeed's files too."""
    _, out, results = lightning_run
    rank0 = results[0]
    files = rank0["checkpoint_files"]
    assert "epoch1.ckpt/checkpoint/zero_pp_rank_0_mp_rank_00_optim_states.pt" in files, files
    checkpoint, weights = rank0["final_checkpoint"], str(out / "weights.pt")
    result = run_worker("lightning_convert.py", tmp_path / "converted", checkpoint, weights)
    assert result["keys"] == result["expected_keys"]  # "model.model.layers.0...." etc.
    assert result["returned_same"] and result["shapes_equal"]
    assert result["dtypes"] == ["torch.float32"]
    assert result["max_abs_diff"] == 0.0  # the fp32 master weights are the model's weights
    # Lightning keeps its own client state beside the weights (from the model-states file)
    assert {"epoch", "global_step"} <= set(result["client_keys"])


@pytest.mark.slow
@needs_peers
@pytest.mark.parametrize("variant", ["z2", "z3"])
def test_lightning_deepspeed_golden(variant: str, tmp_path: Path) -> None:
    record_or_compare(f"lightning_{variant}", "lightning_worker.py", variant, tmp_path)
