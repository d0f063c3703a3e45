"""Data loading for the engine: a distributed-sampler DataLoader and ``RepeatingLoader``."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler


class ShardSpeedDataLoader:
    """Micro-batches of ``dataset`` for this data-parallel rank, in DeepSpeed's order.

    By default it behaves as DeepSpeed 0.19.8's ``DeepSpeedDataLoader`` under a launcher: a
    ``DistributedSampler`` (shuffle for training, seed 0, the sampler pads the dataset to a
    multiple of the data-parallel size; ``dataloader_drop_last`` only drops the last short
    batch) whose epoch is never advanced, so every pass replays the same order; each new
    iterator draws one number from the global torch RNG (a ``DataLoader`` without its own
    generator does), and a checkpoint load does not move the position (DeepSpeed restores
    none). Two explicit options give ShardSpeed's other behaviour:

    Args:
        reshuffle_each_epoch: advance the sampler's epoch on every pass (a new order per
            epoch, the same on every rank).
        exact_resume: iterate with the loader's own generator (the global RNG stream, e.g.
            dropout, does not depend on when iterators are made) and let ``load_state_dict``
            restore epoch and position, so a resumed run sees the batches an uninterrupted
            run would.
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
        reshuffle_each_epoch: bool = False,
        exact_resume: bool = False,
    ) -> None:
        # the sampler pads rather than drops (DeepSpeed builds it without drop_last); the
        # DataLoader's drop_last drops a last short batch
        self.sampler = data_sampler or DistributedSampler(
            dataset, num_replicas=dp_world_size, rank=dp_rank, shuffle=shuffle, seed=seed
        )
        self.reshuffle_each_epoch = reshuffle_each_epoch
        self.exact_resume = exact_resume
        self.loader = DataLoader(
            dataset,
            batch_size=batch_size,
            sampler=self.sampler,
            collate_fn=collate_fn,
            num_workers=num_workers,
            pin_memory=pin_memory and torch.cuda.is_available(),
            drop_last=drop_last,
            generator=torch.Generator() if exact_resume else None,
        )
        self.epoch = 0
        self.position = 0  # batches consumed in the current epoch

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        if self.reshuffle_each_epoch and hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(self.epoch)
        # DeepSpeed: a new iterator starts the pass over; exact_resume continues a pass
        skip, self.position = (self.position if self.exact_resume else 0), 0
        batches = iter(self.loader)  # draws its seed now, as DeepSpeed's iter() does
        return self._run(batches, skip)

    def _run(self, batches: Iterator[Any], skip: int) -> Iterator[Any]:
        for i, batch in enumerate(batches):
            if i < skip:
                continue
            self.position = i + 1
            yield batch
        self.epoch += 1
        self.position = 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore epoch and position with ``exact_resume``; otherwise (DeepSpeed) a loaded
        checkpoint leaves the loader where it is."""
        if self.exact_resume:
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
