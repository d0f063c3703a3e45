"""``CheckpointEngine``: how checkpoint files are created, written, read and committed."""

from __future__ import annotations

import abc
import os
from dataclasses import dataclass
from typing import Any


@dataclass
class CheckpointCommitInfo:
    """What a checkpoint save is about: its tag, folder and whether ``latest`` moves."""

    tag: str
    save_dir: str
    save_latest: bool


class CheckpointEngine(abc.ABC):
    """One checkpoint save is ``create(info)``, then ``save(state_dict, path)`` per file,
    then ``commit(info)`` (the files are complete); ``load(path)`` reads one file back.

    ``config_params`` is the engine's config (subclasses read their options from it).
    """

    def __init__(self, config_params: Any = None) -> None:
        self.name: str | None = None

    @abc.abstractmethod
    def create(self, info: CheckpointCommitInfo) -> None:
        """A save of checkpoint ``info.tag`` starts."""

    @abc.abstractmethod
    def save(self, state_dict: Any, path: str) -> None:
        """Write ``state_dict`` to ``path``."""

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        os.makedirs(path, exist_ok=exist_ok)

    @abc.abstractmethod
    def load(self, path: str, map_location: Any = None) -> Any:
        """Read the object saved at ``path``."""

    @abc.abstractmethod
    def commit(self, info: CheckpointCommitInfo) -> bool:
        """Every file of checkpoint ``info.tag`` is written; make it durable."""

    def is_data_parallel_writer(self, dp_rank: int) -> bool:
        """Whether data-parallel rank ``dp_rank`` writes the replicated files."""
        return dp_rank == 0

    def is_decoupled(self) -> bool:
        """Whether saves complete in the background (after ``commit`` returns)."""
        return False

    def set_commit_info(self, info: CheckpointCommitInfo) -> None:  # noqa: B027 - optional hook
        """Remember ``info`` for a decoupled commit (engines that commit later override it)."""

    def get_commit_info(self) -> CheckpointCommitInfo | None:
        return None

    def cleanup(self) -> None:  # noqa: B027 - optional hook
        """Release resources (writer threads, buffers); nothing by default."""

    def preserves_storage_sharing(self) -> bool:
        """Whether tensors sharing storage stay shared through save/load."""
        return True


__all__ = ["CheckpointCommitInfo", "CheckpointEngine"]
