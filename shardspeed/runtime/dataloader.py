"""Data loading for the engine: a distributed-sampler DataLoader and ``RepeatingLoader``."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler


class ShardSpeedDataLoader:
    """Micro-batches of ``dataset`` for this data-parallel rank; reshuffles every epoch.

    Iterating it again advances the sampler's epoch (so each epoch has a new order, the
    same on every rank). ``state_dict()`` records epoch and position for exact resume.
    """

    def __init__(
        self,
        dataset: Dataset,
        batch_size: int,
        *,
        dp_world_size: int,
        dp_rank: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        collate_fn: Callable | None = None,
        num_workers: int = 0,
        pin_memory: bool = False,
        data_sampler: Any = None,
    ) -> None:
        self.sampler = data_sampler or DistributedSampler(
            dataset,
            num_replicas=dp_world_size,
            rank=dp_rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
        )
        self.loader = DataLoader(
            dataset,
            batch_size=batch_size,
            sampler=self.sampler,
            collate_fn=collate_fn,
            num_workers=num_workers,
            pin_memory=pin_memory and torch.cuda.is_available(),
            drop_last=drop_last,
            # Own generator: iterating must not draw from the global RNG (dropout stream),
            # or a resumed run would diverge from an uninterrupted one.
            generator=torch.Generator(),
        )
        self.epoch = 0
        self.position = 0  # batches consumed in the current epoch

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(self.epoch)
        skip, self.position = self.position, 0
        for i, batch in enumerate(self.loader):
            if i < skip:
                continue
            self.position = i + 1
            yield batch
        self.epoch += 1
        self.position = 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])


class RepeatingLoader:
    """Wraps an iterable so iteration restarts at the end instead of stopping."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.data_iter = iter(loader)

    def __iter__(self) -> RepeatingLoader:
        return self

    def __next__(self) -> Any:
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)
