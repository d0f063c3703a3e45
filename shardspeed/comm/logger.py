"""Comms logger (``comms_logger`` in ds_config) and the always-on recent-ops ring buffer.

Message-size rule (bytes = ``numel * element_size``), the convention of nccl-tests:

* ``all_reduce``, ``reduce``, ``broadcast``, ``send``/``isend``, ``recv``/``irecv``,
  ``all_to_all_single``: the (input) tensor.
* ``all_gather_into_tensor`` and list ``all_gather``: the full gathered OUTPUT
  (world_size x the local input).
* ``reduce_scatter_tensor``: the full INPUT (world_size x the local output).
* ``batch_isend_irecv``: the sum of every op's tensor.
* ``barrier``, ``broadcast_object_list``, ``all_gather_object``: 0 (latency only).

Bus bandwidth = algorithm bandwidth x a factor that makes numbers comparable to link speed:
2(n-1)/n for all_reduce, (n-1)/n for all_gather / reduce_scatter / all_to_all, 1 otherwise.
Bandwidths are in GB/s (1e9 bytes per second), latencies in milliseconds.

When the logger is disabled the collectives pay one boolean check. The ring buffer of the
last :data:`RECENT_OPS_LEN` collectives is kept regardless (a deque append per op) so that
a hang can be explained after the fact (:func:`recent_ops`).
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from shardspeed.comm.sequence import SEQUENCE, dtype_name
from shardspeed.utils.logging import get_logger, log_dist

logger = get_logger(__name__)

RECENT_OPS_LEN = 64

_BUS_FACTORS = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather_into_tensor": lambda n: (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter_tensor": lambda n: (n - 1) / n,
    "all_to_all_single": lambda n: (n - 1) / n,
}


@dataclass
class OpStats:
    """Everything recorded for one op name."""

    count: int = 0
    total_bytes: int = 0
    total_latency_ms: float = 0.0
    latencies_ms: list[float] = field(default_factory=list)
    msg_sizes: list[int] = field(default_factory=list)
    algbw_gbps: list[float] = field(default_factory=list)
    busbw_gbps: list[float] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        n = max(self.count, 1)
        return {
            "count": self.count,
            "total_bytes": self.total_bytes,
            "total_latency_ms": self.total_latency_ms,
            "avg_latency_ms": self.total_latency_ms / n,
            "latencies_ms": list(self.latencies_ms),
            "msg_sizes": list(self.msg_sizes),
            "algbw_gbps": list(self.algbw_gbps),
            "busbw_gbps": list(self.busbw_gbps),
        }


@dataclass
class CommsLogger:
    """State of the comms logger (one per process)."""

    enabled: bool = False
    prof_all: bool = True
    prof_ops: list[str] = field(default_factory=list)
    verbose: bool = False
    debug: bool = False
    stats: dict[str, OpStats] = field(default_factory=dict)

    def wants(self, op: str) -> bool:
        return self.prof_all or op in self.prof_ops

    def record(
        self, op: str, msg_bytes: int, latency_s: float, group_size: int, key: str | None = None
    ) -> None:
        """Add one finished call of ``op`` (stored under ``key``, default ``op``)."""
        latency_ms = latency_s * 1e3
        algbw = msg_bytes / latency_s / 1e9 if latency_s > 0 else 0.0
        factor = _BUS_FACTORS.get(op, lambda n: 1.0)(max(group_size, 1))
        stats = self.stats.setdefault(key or op, OpStats())
        stats.count += 1
        stats.total_bytes += msg_bytes
        stats.total_latency_ms += latency_ms
        stats.latencies_ms.append(latency_ms)
        stats.msg_sizes.append(msg_bytes)
        stats.algbw_gbps.append(algbw)
        stats.busbw_gbps.append(algbw * factor)
        if self.verbose:
            log_dist(
                f"comm op: {op} | time (ms): {latency_ms:.3f} | msg size: {msg_bytes} B | "
                f"algbw (GB/s): {algbw:.3f} | busbw (GB/s): {algbw * factor:.3f}"
            )


COMMS_LOGGER = CommsLogger()
_FIELDS = ("enabled", "prof_all", "prof_ops", "verbose", "debug")


def _field(section: Any, name: str) -> Any:
    if isinstance(section, dict):
        return section.get(name)
    return getattr(section, name, None)


def configure(
    deepspeed_config: Any = None,
    enabled: bool | None = None,
    prof_all: bool | None = None,
    prof_ops: list[str] | None = None,
    verbose: bool | None = None,
    debug: bool | None = None,
) -> None:
    """Set up the comms logger from a config and/or explicit keyword overrides.

    ``deepspeed_config`` may be an object with a ``comms_logger`` attribute (fields
    ``enabled, prof_all, prof_ops, verbose, debug`` as attributes or dict keys), a ds_config
    dict with a ``"comms_logger"`` section, or that section itself (a ds_config without the
    section changes nothing). Explicit keywords win.
    """
    section: Any = None
    if isinstance(deepspeed_config, dict):
        if "comms_logger" in deepspeed_config:
            section = deepspeed_config["comms_logger"]
        elif set(deepspeed_config) <= set(_FIELDS):  # the section itself
            section = deepspeed_config
    elif deepspeed_config is not None:
        section = getattr(deepspeed_config, "comms_logger", None)
    values = {}
    for name in _FIELDS:
        value = _field(section, name) if section is not None else None
        values[name] = value
    overrides = {
        "enabled": enabled,
        "prof_all": prof_all,
        "prof_ops": prof_ops,
        "verbose": verbose,
        "debug": debug,
    }
    for name, value in overrides.items():
        if value is not None:
            values[name] = value
    if values["prof_ops"] is not None and not isinstance(values["prof_ops"], (list, tuple)):
        raise ValueError(
            f"comms_logger.prof_ops must be a list of op names, got {values['prof_ops']!r}; "
            'e.g. ["all_reduce", "all_gather_into_tensor"].'
        )
    for name, value in values.items():
        if value is not None:
            setattr(COMMS_LOGGER, name, list(value) if name == "prof_ops" else bool(value))


def reset_log() -> None:
    """Forget every recorded op (configuration is kept)."""
    COMMS_LOGGER.stats.clear()


def get_logged_comm_ops() -> dict[str, dict[str, Any]]:
    """Recorded ops: ``{op: {count, total_bytes, total_latency_ms, avg_latency_ms,
    latencies_ms, msg_sizes, algbw_gbps, busbw_gbps}}`` (a copy)."""
    return {op: stats.as_dict() for op, stats in COMMS_LOGGER.stats.items()}


def _straggler_ms() -> dict[str, float]:
    """Per op: this rank's total latency minus the fastest rank's (collective call)."""
    import torch.distributed as dist

    mine = {op: s.total_latency_ms for op, s in COMMS_LOGGER.stats.items()}
    if not (dist.is_available() and dist.is_initialized()):
        return dict.fromkeys(mine, 0.0)
    everyone: list[dict[str, float]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(everyone, mine)
    return {op: total - min(r.get(op, total) for r in everyone) for op, total in mine.items()}


def _human_bytes(num: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if num < 1000 or unit == "GB":
            return f"{num:.0f} {unit}" if unit == "B" else f"{num:.2f} {unit}"
        num /= 1000
    return f"{num:.2f} GB"  # pragma: no cover


def log_summary(show_straggler: bool = False) -> str:
    """Return (and log on rank 0) a table of the recorded ops.

    ``show_straggler=True`` adds the time each op spent waiting for the slowest rank; it
    runs a collective, so call it on every rank.
    """
    straggler = _straggler_ms() if show_straggler else {}
    header = [
        "op",
        "count",
        "total MB",
        "avg lat (ms)",
        "total lat (ms)",
        "algbw GB/s",
        "busbw GB/s",
    ]
    if show_straggler:
        header.append("straggler (ms)")
    rows = [header]
    for op in sorted(COMMS_LOGGER.stats):
        s = COMMS_LOGGER.stats[op]
        n = max(s.count, 1)
        row = [
            op,
            str(s.count),
            _human_bytes(s.total_bytes),
            f"{s.total_latency_ms / n:.3f}",
            f"{s.total_latency_ms:.3f}",
            f"{sum(s.algbw_gbps) / n:.3f}",
            f"{sum(s.busbw_gbps) / n:.3f}",
        ]
        if show_straggler:
            row.append(f"{straggler.get(op, 0.0):.3f}")
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    table = "\n".join(lines)
    log_dist("Communication summary\n" + table)
    return table


# ----------------------------------------------------------------- recent ops ring buffer
# (seq, op, group, numel, dtype, tag, async_op); group size and dtype name resolved on read
_RECENT: deque[tuple[int, str, Any, int, Any, str | None, bool]] = deque(maxlen=RECENT_OPS_LEN)
_SEQ = itertools.count()
_TAG: list[str | None] = [None]
_LAST = threading.local()  # per thread: the entry of the collective it issued last


def note_op(op: str, group: Any, numel: int, dtype: Any, async_op: bool) -> None:
    """Append one issued collective to the ring buffer (called by every wrapper).

    When the collective-sequence check records (:data:`shardspeed.comm.sequence.SEQUENCE`),
    the op is also folded into this rank's sequence fingerprint.
    """
    tag = _TAG[0]
    entry = (next(_SEQ), op, group, numel, dtype, tag, async_op)
    _RECENT.append(entry)
    _LAST.entry = entry
    if SEQUENCE.enabled:
        SEQUENCE.record(op, group, numel, dtype, tag)


def last_entry() -> tuple[Any, ...] | None:
    """The ring-buffer entry ``(seq, op, group, numel, dtype, tag, async_op)`` of the
    collective this thread issued last, or None."""
    return getattr(_LAST, "entry", None)


def recent_entries() -> list[tuple[Any, ...]]:
    """The raw ring buffer, oldest first (for failure reports)."""
    return list(_RECENT)


def _group_size(group: Any) -> int | None:
    try:
        import torch.distributed as dist

        if group is None:
            return dist.get_world_size() if dist.is_initialized() else None
        return group.size()
    except Exception:  # the group may be gone by the time we are asked
        return None


def recent_ops() -> list[dict[str, Any]]:
    """The last collectives this rank issued, oldest first.

    Each entry: ``seq`` (issue number since reset), ``op``, ``group_size``, ``numel`` (of the
    tensor whose bytes are counted, see the module docstring), ``dtype``, ``tag`` (from
    :func:`set_current_tag`) and ``async_op``.
    """
    out = []
    for seq, op, group, numel, dtype, tag, async_op in list(_RECENT):
        out.append(
            {
                "seq": seq,
                "op": op,
                "group_size": _group_size(group),
                "numel": numel,
                "dtype": dtype_name(dtype),
                "tag": tag,
                "async_op": async_op,
            }
        )
    return out


class set_current_tag:  # noqa: N801 - a context manager with DeepSpeed-style function name
    """Label every collective issued inside the block (e.g. ``"zero.reduce_grads bucket 3"``).

    The label names the module or phase the collectives serve; it shows in
    :func:`recent_ops`, in timeout reports and in the collective-sequence check. Blocks
    nest (the innermost label wins). A plain class rather than a generator-based
    context manager: hot paths (stage-3 gathers, bucket reductions) enter one per
    collective.
    """

    __slots__ = ("_previous", "tag")

    def __init__(self, tag: str) -> None:
        self.tag = tag
        self._previous: str | None = None

    def __enter__(self) -> None:
        self._previous = _TAG[0]
        _TAG[0] = self.tag

    def __exit__(self, *exc_info: object) -> None:
        _TAG[0] = self._previous


def current_tag() -> str | None:
    """The label set by the innermost active :func:`set_current_tag` (None outside any)."""
    return _TAG[0]


def forget_groups() -> None:
    """Drop the ring buffer's entries (they hold their process groups, whose gloo threads
    would live on after the world is destroyed)."""
    _RECENT.clear()
    _LAST.__dict__.clear()


def reset_state() -> None:
    """Back to a fresh process: logger off, nothing recorded, empty ring buffer."""
    global _SEQ
    fresh = CommsLogger()
    for name in ("enabled", "prof_all", "prof_ops", "verbose", "debug", "stats"):
        setattr(COMMS_LOGGER, name, getattr(fresh, name))
    _RECENT.clear()
    _SEQ = itertools.count()
    _TAG[0] = None
    _LAST.__dict__.clear()
    SEQUENCE.reset()
