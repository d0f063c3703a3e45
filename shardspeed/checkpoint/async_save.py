"""Asynchronous checkpoint saves: write and commit on a background thread.

The training thread takes the snapshot (host copies of every tensor, JSON engine state)
and returns; a writer thread writes this rank's files and runs the commit
(:func:`shardspeed.checkpoint.commit.commit`). The commit's two agreements are
collectives, so they run on a *dedicated gloo group* made for checkpoints: a collective
on the training group from another thread could interleave with the training thread's
collectives and deadlock. At most one save is in flight per engine: the next save, a
load, ``engine.wait_checkpoint()`` and ``engine.destroy()`` wait for it, and a failed
save raises :class:`~shardspeed.checkpoint.commit.CheckpointError` there.

The writer thread is not a daemon, so an interpreter that exits normally finishes (or
fails) the pending save first. Call ``engine.wait_checkpoint()`` before destroying the
process group yourself.
"""

from __future__ import annotations

import threading
from typing import Any

from shardspeed import comm
from shardspeed.checkpoint.commit import CheckpointError, RankSnapshot, commit, write_rank_files
from shardspeed.utils.logging import get_logger, log_dist

logger = get_logger(__name__)

_ATTR = "_shardspeed_save_coordinator"


class SaveCoordinator:
    """One engine's checkpoint group and its in-flight asynchronous save (at most one).

    ``group`` (gloo, every rank) carries the commit's agreements of synchronous saves too.
    """

    def __init__(self, group: Any) -> None:
        self.group = group  # gloo group over every rank, or None for a world of one
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._tag: str | None = None

    @property
    def pending(self) -> bool:
        return self._thread is not None

    def submit(self, snap: RankSnapshot) -> None:
        """Write and commit ``snap`` in the background; the previous save must be done."""
        assert self._thread is None, "wait() for the previous save first"
        self._tag = str(snap.final)
        self._thread = threading.Thread(
            target=self._run, args=(snap,), name="shardspeed-ckpt-writer", daemon=False
        )
        self._thread.start()

    def _run(self, snap: RankSnapshot) -> None:
        write_error: BaseException | None = None
        try:
            write_rank_files(snap)
        except Exception as err:  # agreed with the other ranks in commit()
            write_error = err
        snap.tensors.clear()  # free the host copies before waiting for slower ranks
        try:
            commit(snap, write_error, self.group)
            log_dist(f"saved checkpoint {snap.final} (asynchronously)")
        except Exception as err:  # surfaced by wait()
            self._error = err

    def wait(self) -> None:
        """Block until the pending save is committed; raise if it failed on any rank."""
        if self._thread is None:
            return
        self._thread.join()
        self._thread = None
        error, self._error = self._error, None
        if error is None:
            return
        if isinstance(error, CheckpointError):
            raise error
        raise CheckpointError(
            f"the asynchronous save of {self._tag} failed before its tag was published "
            f"({type(error).__name__}: {error}); the previous checkpoint and 'latest' are "
            "unchanged."
        ) from error


def save_coordinator(engine: Any) -> SaveCoordinator:
    """The engine's :class:`SaveCoordinator`, made on first use (a collective call then)."""
    saver: SaveCoordinator | None = getattr(engine, _ATTR, None)
    if saver is None:
        world = comm.get_world_size() if comm.is_initialized() else 1
        saver = SaveCoordinator(comm.new_group(backend="gloo") if world > 1 else None)
        object.__setattr__(engine, _ATTR, saver)  # a plain attribute, not a submodule
    return saver


def wait_pending(engine: Any, *, raise_error: bool = True) -> None:
    """Wait for ``engine``'s in-flight async save; raise (or log) its failure."""
    saver: SaveCoordinator | None = getattr(engine, _ATTR, None)
    if saver is None or not saver.pending:
        return
    try:
        saver.wait()
    except CheckpointError as err:
        if raise_error:
            raise
        logger.error(f"{err}")
