"""``shardspeed.runtime.elastic_resume``: where the data loader continues after a resume.

The full resume (a checkpoint saved at world 2 loaded at world 1 and back, losses equal to
an uninterrupted run) is the elastic drill in ``tests/multinode/test_elastic_drill.py``.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from shardspeed.runtime.dataloader import ShardSpeedDataLoader
from shardspeed.runtime.elastic_resume import (
    ElasticResume,
    ElasticResumeError,
    _move_loader,
    latest_committed,
    resume_elastic,
)


def _loader(world: int, rank: int, micro: int, exact: bool = True) -> ShardSpeedDataLoader:
    data = torch.utils.data.TensorDataset(torch.arange(24))
    return ShardSpeedDataLoader(data, micro, dp_world_size=world, dp_rank=rank,
                                exact_resume=exact)  # fmt: skip


def _samples(loaders: list[ShardSpeedDataLoader], gas: int, steps: int) -> list[set[int]]:
    """The samples of each optimizer step (all ranks, all micro batches)."""
    iters = [iter(loader) for loader in loaders]
    out = []
    for _ in range(steps):
        step: set[int] = set()
        for _ in range(gas):
            for it in iters:
                step.update(next(it)[0].tolist())
        out.append(step)
    return out


@pytest.mark.parametrize(("world", "micro", "gas"), [(1, 2, 2), (2, 1, 2), (4, 1, 1), (2, 2, 1)])
def test_a_moved_loader_continues_with_the_next_global_batch(world: int, micro: int, gas: int):
    """Global batch 4: 3 steps on 2 ranks (micro 1, GAS 2), then any split continues
    with exactly the samples an uninterrupted run would train on next."""
    full = _samples([_loader(2, r, 1) for r in range(2)], 2, 6)
    loaders = [_loader(world, r, micro) for r in range(world)]
    for loader in loaders:
        assert _move_loader(loader, 3 * 4, micro * world) == (0, 3 * 4 // (micro * world))
    assert _samples(loaders, gas, 3) == full[3:]


def test_samples_that_do_not_fill_this_worlds_batches_are_refused():
    with pytest.raises(ElasticResumeError, match="12 samples, not a whole number .* of 8"):
        _move_loader(_loader(4, 0, 2), 12, 8)


def test_a_loader_without_exact_resume_is_left_alone_with_the_fix(
    caplog: pytest.LogCaptureFixture,
):
    logger = logging.getLogger("shardspeed")
    logger.addHandler(caplog.handler)
    try:
        loader = _loader(1, 0, 2, exact=False)
        assert _move_loader(loader, 4, 2) == (None, None) and loader.position == 0
        assert "exact_resume=True" in caplog.text
    finally:
        logger.removeHandler(caplog.handler)
    assert _move_loader(None, 4, 2) == (None, None)


def test_no_checkpoint_is_a_fresh_start(tmp_path: Path):
    assert latest_committed(tmp_path / "missing") is None
    assert latest_committed(tmp_path) is None
    assert resume_elastic(object(), tmp_path) is None  # the engine is not touched


def test_changes_line_names_what_differs():
    resumed = ElasticResume("p", 5, 10, 2, 1, 3, 3, 1, 1, 1, 2, 2, 0, 10)
    assert resumed.changes() == "world 2 -> 1, ZeRO stage 3, micro batch 1, GAS 1 -> 2"
