"""The sample order of an engine dataloader, as a function of how it is built.

Runs under DeepSpeed 0.19.8 (``.venv-peers``: ``python dataloader_order_cases.py OUT``
builds ``deepspeed.runtime.dataloader.DeepSpeedDataLoader`` the way
``engine.deepspeed_io`` does under a launcher) and under ShardSpeed
(``shardspeed.runtime.dataloader.ShardSpeedDataLoader``, imported by the test). Per case
(dataset size, micro-batch, data-parallel size, ``dataloader_drop_last``) and per rank:
the length, three full passes of sample ids, and a draw from the global torch RNG after
each pass (what iterating took from the stream dropout uses). Only torch here.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

import torch

# (dataset size, micro batch, data-parallel size, drop_last)
CASES = [
    (10, 2, 1, False),
    (11, 2, 2, False),
    (11, 2, 2, True),
    (13, 3, 3, False),
    (13, 3, 3, True),
]


class Ids(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


Factory = Callable[[Any, int, int, int, bool], Any]


def orders(make_loader: Factory) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for n, micro, dp, drop_last in CASES:
        for rank in range(dp):
            torch.manual_seed(1234)
            loader = make_loader(Ids(n), micro, dp, rank, drop_last)
            passes, draws = [], []
            for _ in range(3):
                passes.append([[int(v) for v in batch] for batch in loader])
                draws.append(float(torch.rand(1)))
            out[f"n{n}_b{micro}_dp{dp}_drop{int(drop_last)}_r{rank}"] = {
                "len": len(loader),
                "passes": passes,
                "draws": draws,
            }
    return out


def deepspeed_loader(dataset: Any, micro: int, dp: int, rank: int, drop_last: bool) -> Any:
    from deepspeed.runtime.dataloader import DeepSpeedDataLoader

    return DeepSpeedDataLoader(
        dataset=dataset,
        batch_size=micro,
        pin_memory=True,
        local_rank=0,  # any launcher sets LOCAL_RANK
        tput_timer=None,
        num_local_io_workers=0,  # the order does not depend on workers
        data_parallel_world_size=dp,
        data_parallel_rank=rank,
        dataloader_drop_last=drop_last,
    )


if __name__ == "__main__":
    with open(sys.argv[1], "w") as handle:
        json.dump(orders(deepspeed_loader), handle)
