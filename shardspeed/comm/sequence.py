"""Collective-sequence fingerprints: did every rank issue the same collectives?

When recording is on, every collective issued through :mod:`shardspeed.comm` is reduced
to a *key* ``(op, group shape, numel, dtype, tag)`` and folded into a running 62-bit
fingerprint, and a bounded history keeps the last records with the fingerprint after
each (its *prefix*). Two ranks that issued the same sequence hold the same fingerprint;
the first index where their prefixes differ is the first divergent collective.

Keys are chosen to be equal on data-parallel peers that do the same thing:

* the group enters as its *shape*, its sorted ranks minus the smallest
  (``[2, 3]`` and ``[0, 1]`` are both ``(0, 1)``), so peers using "their" tensor or pipe
  group agree, while groups of different axes (``(0, 1)`` vs ``(0, 2)``) still differ;
* point-to-point ops enter as ``"p2p"`` (a send and its matching receive agree);
* ``tag`` is the module/phase label of :func:`shardspeed.comm.set_current_tag`.

Only the thread that started recording (the training thread) is recorded: collectives
that a background thread issues on its own group (e.g. an asynchronous checkpoint's
commit) interleave with training at no fixed point, so they would make ranks disagree.

Hashes are deterministic (blake2b, not Python's per-process ``hash``), so ranks in
different processes compare. Recording costs one ``if`` per collective when off, and a
dictionary lookup, a multiply and a deque append when on.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
import weakref
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

MASK = (1 << 62) - 1
_MIX = 0x100000001B3  # FNV-1 64-bit prime
P2P_OPS = frozenset({"send", "recv", "isend", "irecv", "batch_isend_irecv"})
DEFAULT_HISTORY = 4096
_KEY_CACHE_LIMIT = 1 << 16


def group_shape(ranks: Sequence[int]) -> tuple[int, ...]:
    """Sorted ranks minus the smallest: equal for translated copies of one axis group."""
    if not ranks:
        return ()
    ordered = sorted(ranks)
    return tuple(r - ordered[0] for r in ordered)


def key_hash(
    op: str, shape: tuple[int, ...], numel: int, dtype: str | None, tag: str | None
) -> int:
    """Deterministic 62-bit hash of one collective's key (p2p ops are direction-free)."""
    name = "p2p" if op in P2P_OPS else op
    text = repr((name, shape, int(numel), dtype, tag)).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") & MASK


def mix(fingerprint: int, key: int) -> int:
    """Fold one key into a running fingerprint (order-sensitive)."""
    return ((fingerprint * _MIX) ^ key) & MASK


def dtype_name(dtype: Any) -> str | None:
    """``torch.bfloat16`` -> ``"bfloat16"``; None stays None."""
    return None if dtype is None else str(dtype).replace("torch.", "")


# ----------------------------------------------------------------------- group ranks
_GROUP_RANKS: weakref.WeakKeyDictionary[Any, tuple[int, ...]] = weakref.WeakKeyDictionary()


def group_ranks(group: Any) -> tuple[int, ...]:
    """Global ranks of ``group`` (None: the world); ``()`` if it cannot be told."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return (0,)
    if group is None or group is dist.GroupMember.WORLD:
        return tuple(range(dist.get_world_size()))
    try:
        return _GROUP_RANKS[group]
    except (KeyError, TypeError):
        pass
    try:
        ranks = tuple(dist.get_process_group_ranks(group))
    except (RuntimeError, ValueError):  # a destroyed or foreign group
        return ()
    with contextlib.suppress(TypeError):
        _GROUP_RANKS[group] = ranks
    return ranks


def format_ranks(ranks: Sequence[int]) -> str:
    """``[0, 1, 2, 3]`` -> ``"[0-3]"``; short lists are spelled out."""
    if not ranks:
        return "[?]"
    if len(ranks) > 4 and list(ranks) == list(range(ranks[0], ranks[0] + len(ranks))):
        return f"[{ranks[0]}-{ranks[-1]}]"
    if len(ranks) > 8:
        return "[" + ", ".join(map(str, ranks[:8])) + f", ... ({len(ranks)} ranks)]"
    return "[" + ", ".join(map(str, ranks)) + "]"


@dataclass(frozen=True)
class _GroupInfo:
    ranks: tuple[int, ...]
    shape: tuple[int, ...]
    digest: int  # of the shape: a cheap dictionary key even for a 1024-rank group

    @classmethod
    def of(cls, ranks: tuple[int, ...]) -> _GroupInfo:
        shape = group_shape(ranks)
        digest = int.from_bytes(hashlib.blake2b(repr(shape).encode(), digest_size=8).digest())
        return cls(tuple(ranks), shape, digest)


# ----------------------------------------------------------------------- records
@dataclass(frozen=True)
class CollectiveRecord:
    """One recorded collective: its position in the sequence and what it was."""

    index: int  # 0-based position since recording started
    op: str
    group_ranks: tuple[int, ...]
    numel: int
    dtype: str | None
    tag: str | None
    prefix: int  # fingerprint after this collective

    def describe(self) -> str:
        tag = f" module/phase={self.tag!r}" if self.tag else " module/phase=<untagged>"
        return (
            f"#{self.index} {self.op} numel={self.numel} dtype={self.dtype} "
            f"group={format_ranks(self.group_ranks)}{tag}"
        )


@dataclass(frozen=True)
class SequenceSnapshot:
    """What one rank sends when sequences are compared (picklable, bounded)."""

    rank: int
    count: int  # collectives recorded
    fingerprint: int
    verified: int  # count at the last check every rank agreed on
    records: tuple[CollectiveRecord, ...]  # the most recent, oldest first

    def at(self, index: int) -> CollectiveRecord | None:
        if not self.records or index < self.records[0].index or index >= self.count:
            return None
        return self.records[index - self.records[0].index]


class SequenceRecorder:
    """Running fingerprint and bounded history of this process's collectives."""

    def __init__(self) -> None:
        self.enabled = False
        self._history: deque[tuple[Any, ...]] = deque(maxlen=DEFAULT_HISTORY)
        self._keys: dict[tuple[Any, ...], int] = {}
        self._groups: weakref.WeakKeyDictionary[Any, _GroupInfo] = weakref.WeakKeyDictionary()
        self._world: _GroupInfo | None = None
        self.count = 0
        self.fingerprint = 0
        self.verified = 0
        self._thread = threading.get_ident()

    def start(self, history: int = DEFAULT_HISTORY) -> None:
        """Forget everything and record from now on, keeping the last ``history`` records."""
        if history < 1:
            raise ValueError(f"collective_check.history must be >= 1, got {history}.")
        self._history = deque(maxlen=history)
        self.count = self.fingerprint = self.verified = 0
        self._world = None
        self._thread = threading.get_ident()
        self.enabled = True

    def stop(self) -> None:
        self.enabled = False

    def reset(self) -> None:
        """Back to a fresh process: off, empty."""
        self.stop()
        self._history.clear()
        self._keys.clear()
        self._groups = weakref.WeakKeyDictionary()
        self._world = None
        self.count = self.fingerprint = self.verified = 0

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Collectives issued inside are not recorded (the check's own)."""
        was = self.enabled
        self.enabled = False
        try:
            yield
        finally:
            self.enabled = was

    def _group(self, group: Any) -> _GroupInfo:
        """Ranks, shape and shape digest of ``group``, computed once per group."""
        if group is None:  # the world: fixed until the process group is destroyed (reset)
            if self._world is None:
                self._world = _GroupInfo.of(group_ranks(None))
            return self._world
        try:
            return self._groups[group]
        except (KeyError, TypeError):
            pass
        info = _GroupInfo.of(group_ranks(group))
        with contextlib.suppress(TypeError):
            self._groups[group] = info
        return info

    def record(self, op: str, group: Any, numel: int, dtype: Any, tag: str | None) -> None:
        """Fold one issued collective on ``group`` (a process group or None) into the sequence
        (ignored outside the recording thread)."""
        if threading.get_ident() != self._thread:
            return
        self._record(op, self._group(group), numel, dtype, tag)

    def record_ranks(
        self, op: str, ranks: tuple[int, ...], numel: int, dtype: Any, tag: str | None
    ) -> None:
        """:meth:`record` with the group given as its global ranks (no process group needed)."""
        self._record(op, _GroupInfo.of(ranks), numel, dtype, tag)

    def _record(self, op: str, info: _GroupInfo, numel: int, dtype: Any, tag: str | None) -> None:
        cache_key = (op, info.digest, numel, dtype, tag)
        key = self._keys.get(cache_key)
        if key is None:
            if len(self._keys) >= _KEY_CACHE_LIMIT:
                self._keys.clear()
            key = key_hash(op, info.shape, numel, dtype_name(dtype), tag)
            self._keys[cache_key] = key
        self.fingerprint = mix(self.fingerprint, key)
        self._history.append((self.count, op, info.ranks, numel, dtype, tag, self.fingerprint))
        self.count += 1

    def mark_verified(self) -> None:
        """Every rank agreed up to here (called by the check)."""
        self.verified = self.count

    def snapshot(self, rank: int) -> SequenceSnapshot:
        records = tuple(
            CollectiveRecord(i, op, ranks, numel, dtype_name(dtype), tag, prefix)
            for i, op, ranks, numel, dtype, tag, prefix in self._history
        )
        return SequenceSnapshot(rank, self.count, self.fingerprint, self.verified, records)


SEQUENCE = SequenceRecorder()
"""The process-wide recorder fed by every :mod:`shardspeed.comm` collective."""


# ----------------------------------------------------------------------- comparison
@dataclass(frozen=True)
class Divergence:
    """Where the sequences of several ranks first differ."""

    index: int
    exact: bool  # False: older records were dropped; the divergence is at or before index
    snapshots: tuple[SequenceSnapshot, ...]


def first_divergence(snapshots: Sequence[SequenceSnapshot]) -> Divergence | None:
    """The first index whose prefix fingerprint differs across ranks (None: all agree)."""
    snaps = tuple(snapshots)
    if len({(s.count, s.fingerprint) for s in snaps}) <= 1:
        return None
    first_kept = max((s.records[0].index if s.records else s.count) for s in snaps)
    start = max(first_kept, min(s.verified for s in snaps))
    end = max(s.count for s in snaps)
    for i in range(start, end):
        prefixes = {None if (r := s.at(i)) is None else r.prefix for s in snaps}
        if len(prefixes) > 1:
            exact = i == 0 or i > start or i <= min(s.verified for s in snaps)
            return Divergence(i, exact, snaps)
    return Divergence(start, False, snaps)


def format_divergence(div: Divergence, context: int = 3) -> str:
    """Per rank: the ``context`` records before the first divergent collective, then it."""
    where = f"#{div.index}" if div.exact else f"at or before #{div.index}"
    lines = [f"first divergent collective: {where} (0-based, counted since recording started)"]
    if not div.exact:
        lines.append(
            "  (older records were dropped: raise collective_check.history or lower "
            "collective_check.interval to see the exact collective)"
        )
    for snap in sorted(div.snapshots, key=lambda s: s.rank):
        lines.append(f"  rank {snap.rank}:")
        for j in range(max(div.index - context, 0), min(div.index, snap.count)):
            before = snap.at(j)
            if before is not None:
                lines.append(f"       {before.describe()}")
        record = snap.at(div.index)
        if record is not None:
            lines.append(f"    -> {record.describe()}")
        elif div.index >= snap.count:
            lines.append(
                f"    -> no collective #{div.index}: this rank issued {snap.count} in total"
            )
        else:
            lines.append(f"    -> #{div.index} is no longer in this rank's history")
    return "\n".join(lines)
