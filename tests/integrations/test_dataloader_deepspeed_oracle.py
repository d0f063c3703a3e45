"""The engine's dataloader against DeepSpeed 0.19.8's ``DeepSpeedDataLoader`` (oracle).

``dataloader_order_cases.py`` builds DeepSpeed's loader (in ``.venv-peers``) and
ShardSpeed's with the same arguments for several dataset sizes, micro-batches,
data-parallel sizes and ``dataloader_drop_last``, and records per rank the length, three
passes of sample ids and the global RNG draw after each pass. They must be identical:
DeepSpeed replays one order every pass (its ``DistributedSampler`` epoch is never
advanced), pads the dataset to a multiple of the data-parallel size, and each iterator
takes one number from the global RNG. DeepSpeed's orders are recorded in
``tests/goldens/dataloader/`` (the golden variant, run everywhere); the live variant runs
where the peers venv has DeepSpeed (``tests/goldens/README.md``).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from dataloader_order_cases import Ids, orders
from goldens import deepspeed_oracle as golden

from shardspeed.runtime.dataloader import ShardSpeedDataLoader

HERE = Path(__file__).resolve().parent


def shardspeed_loader(dataset: Any, micro: int, dp: int, rank: int, drop_last: bool) -> Any:
    """As ``engine.deepspeed_io`` builds it for the train route."""
    return ShardSpeedDataLoader(
        dataset, micro, dp_world_size=dp, dp_rank=rank, shuffle=True, drop_last=drop_last
    )


def _deepspeed_orders(out: Path) -> dict[str, Any]:
    done = subprocess.run(
        [golden.live_python(), str(HERE / "dataloader_order_cases.py"), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return {"orders": json.loads(out.read_text())}


@pytest.mark.parametrize("source", golden.ORACLE_SOURCES)
def test_same_order_and_rng_use_as_deepspeed(source: str, tmp_path: Path) -> None:
    theirs = golden.deepspeed_side(
        source, "dataloader", "orders.json", lambda: _deepspeed_orders(tmp_path / "ds.json")
    )["orders"]
    ours = orders(shardspeed_loader)
    assert ours.keys() == theirs.keys()
    for key in theirs:
        assert ours[key] == theirs[key], key


def test_default_replays_one_order_and_load_keeps_position() -> None:
    loader = shardspeed_loader(Ids(8), 2, 2, 0, False)
    first, second = [b.tolist() for b in loader], [b.tolist() for b in loader]
    assert first == second and len(first) == 2
    state = {"epoch": 5, "position": 1}
    loader.load_state_dict(state)  # DeepSpeed restores no dataloader position
    assert [b.tolist() for b in loader] == first


def test_explicit_options_reshuffle_and_resume_exactly() -> None:
    torch.manual_seed(0)
    loader = ShardSpeedDataLoader(
        Ids(12), 2, dp_world_size=1, dp_rank=0, reshuffle_each_epoch=True, exact_resume=True
    )
    before = torch.get_rng_state()
    epoch0, epoch1 = [b.tolist() for b in loader], [b.tolist() for b in loader]
    assert torch.equal(before, torch.get_rng_state())  # own generator: global RNG untouched
    assert epoch0 != epoch1 and sorted(sum(epoch0, [])) == sorted(sum(epoch1, [])) == list(
        range(12)
    )
    fresh = ShardSpeedDataLoader(
        Ids(12), 2, dp_world_size=1, dp_rank=0, reshuffle_each_epoch=True, exact_resume=True
    )
    fresh.load_state_dict({"epoch": 1, "position": 2})  # two batches into epoch 1
    assert [b.tolist() for b in fresh] == epoch1[2:]
