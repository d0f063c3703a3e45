"""DeepSpeed's comms-logger record (``deepspeed.utils.comms_logging``).

:class:`CommsLogger` keeps DeepSpeed's table of collective timings,
``{record_name: {msg_size: [count, [latency_ms], [algbw_gbps], [busbw_gbps]]}}``, and
:func:`calc_bw_log` computes DeepSpeed's bandwidths from one call's size (bytes, per rank)
and duration (milliseconds), in Gbit/s, for ``n`` ranks:

* ``all_to_all(_single)``: algbw = size / t, busbw = algbw * (n-1)/n;
* ``all_gather(_into_tensor)``, ``reduce_scatter(_tensor)``: algbw = n * size / t,
  busbw = algbw * (n-1)/n;
* ``all_reduce(_coalesced)``, ``inference_all_reduce``: algbw = 2 * size / t,
  busbw = size / t * 2(n-1)/n;
* ``send``, ``recv``, ``isend``, ``irecv``, ``batch_isend_irecv``, ``broadcast(_object_list)``,
  ``reduce``, ``gather``, ``scatter``, ``barrier``: algbw = busbw = size / t.

ShardSpeed's collectives record into :mod:`shardspeed.comm.logger` (its own per-op
summary, in GB/s); this module is the DeepSpeed-shaped object that scripts build and feed
themselves. It sits below ``comm`` and imports nothing from it.
"""

from __future__ import annotations

import math
import sys
from datetime import datetime
from typing import Any

from shardspeed.utils.logging import get_logger, log_dist

logger = get_logger(__name__)

_SIZE_UNITS = ("B", "KB", "MB", "GB", "TB", "PB", "EB", "ZB", "YB")
_ALL_TO_ALL = frozenset({"all_to_all_single", "all_to_all"})
_GATHER_SCATTER = frozenset(
    {"all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor"}
)
_ALL_REDUCE = frozenset({"all_reduce", "all_reduce_coalesced", "inference_all_reduce"})
_POINT_TO_POINT = frozenset(
    {
        "send",
        "recv",
        "isend",
        "irecv",
        "batch_isend_irecv",
        "broadcast",
        "broadcast_object_list",
        "reduce",
        "gather",
        "scatter",
        "barrier",
    }
)
KNOWN_OPS = _ALL_TO_ALL | _GATHER_SCATTER | _ALL_REDUCE | _POINT_TO_POINT


def get_caller_func(frame: int = 3) -> str:
    """Name of the function ``frame`` levels up the call stack (DeepSpeed's log-name default)."""
    return sys._getframe(frame).f_code.co_name


def convert_size(size_bytes: float) -> str:
    """Human-readable size in powers of 1024: ``1536`` -> ``"1.5 KB"``, ``0`` -> ``"0B"``."""
    if size_bytes == 0:
        return "0B"
    exponent = int(math.floor(math.log(size_bytes, 1024)))
    return f"{round(size_bytes / math.pow(1024, exponent), 2)} {_SIZE_UNITS[exponent]}"


def _world_size() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1


def calc_bw_log(
    comm_op: str, size: float, duration: float, world_size: int | None = None
) -> tuple[float, float]:
    """``(algbw, busbw)`` in Gbit/s for one ``comm_op`` of ``size`` bytes over ``duration`` ms.

    ``world_size`` defaults to the default process group's size (1 without one).

    Raises:
        ValueError: ``comm_op`` is not one of :data:`KNOWN_OPS`.
    """
    n = _world_size() if world_size is None else world_size
    if comm_op in _ALL_TO_ALL:
        algbw = size / duration
        busbw = algbw * (n - 1) / n
    elif comm_op in _GATHER_SCATTER:
        algbw = size * n / duration
        busbw = algbw * (n - 1) / n
    elif comm_op in _ALL_REDUCE:
        algbw = 2 * size / duration
        busbw = size / duration * (2 * (n - 1) / n)
    elif comm_op in _POINT_TO_POINT:
        algbw = busbw = size / duration
    else:
        raise ValueError(
            f"calc_bw_log: comm_op={comm_op!r} is not a known collective; allowed: "
            f"{', '.join(sorted(KNOWN_OPS))}. Pass the op's raw name (e.g. 'all_reduce')."
        )
    # bytes per ms -> Gbit/s: * 8 bits * 1e3 ms/s / 1e9
    return algbw * 8 / 1e6, busbw * 8 / 1e6


def trim_mean(data: list[float], trim_percent: float) -> float:
    """Mean of ``data`` without the lowest and highest ``trim_percent`` (0 when empty)."""
    if not 0.0 <= trim_percent <= 1.0:
        raise ValueError(f"trim_percent must be in [0, 1], got {trim_percent!r}.")
    if not data:
        return 0
    ordered = sorted(data)
    k = int(round(len(ordered) * trim_percent))
    kept = ordered[k : len(ordered) - k]
    return sum(kept) / len(kept)


def _section_value(section: Any, name: str, default: Any) -> Any:
    value = section.get(name) if isinstance(section, dict) else getattr(section, name, None)
    return default if value is None else value


class CommsLogger:
    """Timings of logged collectives, by record name and message size."""

    def __init__(self) -> None:
        self.comms_dict: dict[str, dict[int, list[Any]]] = {}
        self.verbose = False
        self.debug = False
        self.prof_ops: list[str] = []
        self.prof_all = True
        self.enabled = False

    def configure(self, comms_config: Any) -> None:
        """Read the ``comms_logger`` settings.

        ``comms_config``: DeepSpeed's comms config (``comms_logger_enabled`` plus a
        ``comms_logger`` object), any object with a ``comms_logger`` section, or a ds_config
        dict. A section that is present enables logging unless it says ``enabled: false``.
        """
        if isinstance(comms_config, dict):
            section = comms_config.get("comms_logger")
        else:
            section = getattr(comms_config, "comms_logger", None)
        if hasattr(comms_config, "comms_logger_enabled"):
            self.enabled = bool(comms_config.comms_logger_enabled)
        else:
            self.enabled = section is not None and bool(_section_value(section, "enabled", True))
        if self.enabled and section is not None:
            self.verbose = bool(_section_value(section, "verbose", False))
            self.debug = bool(_section_value(section, "debug", False))
            self.prof_ops = list(_section_value(section, "prof_ops", []))
            self.prof_all = bool(_section_value(section, "prof_all", True))

    def start_profiling_comms(self) -> None:
        self.prof_all = True

    def stop_profiling_comms(self) -> None:
        self.prof_all = False

    def start_profiling_op(self, op_name_list: list[str]) -> None:
        self.prof_ops = list(set(self.prof_ops) | set(op_name_list))

    def stop_profiling_op(self, op_name_list: list[str]) -> None:
        self.prof_ops = [op for op in self.prof_ops if op not in op_name_list]

    def append(self, raw_name: str, record_name: str, latency: float, msg_size: int) -> None:
        """Record one ``raw_name`` call (``latency`` ms, ``msg_size`` bytes) as ``record_name``."""
        algbw, busbw = calc_bw_log(raw_name, msg_size, latency)
        by_size = self.comms_dict.setdefault(record_name, {})
        entry = by_size.setdefault(msg_size, [0, [], [], []])
        entry[0] += 1
        entry[1].append(latency)
        entry[2].append(algbw)
        entry[3].append(busbw)
        if self.verbose:
            log_dist(
                f"comm op: {record_name} | time (ms): {latency:.2f} | msg size: "
                f"{convert_size(msg_size)} | algbw (Gbps): {algbw:.2f} | busbw (Gbps): {busbw:.2f}"
            )

    def get_raw_data(self) -> dict[str, dict[int, list[Any]]]:
        """A shallow copy of the record table."""
        return self.comms_dict.copy()

    def has_data(self) -> bool:
        return len(self.comms_dict) > 0

    def reset_data(self) -> None:
        self.comms_dict.clear()

    def get_operation_names(self) -> list[str]:
        return list(self.comms_dict)

    def get_total_operations(self) -> int:
        """Calls logged, over every record name and message size."""
        return sum(entry[0] for sizes in self.comms_dict.values() for entry in sizes.values())

    def get_operation_summary(self, operation_name: str) -> dict[int, dict[str, Any]] | None:
        """Per message size of ``operation_name``: count, latencies and bandwidths (10%-trimmed
        means); None if it was never logged."""
        if operation_name not in self.comms_dict:
            return None
        return {
            size: _size_summary(size, entry)
            for size, entry in self.comms_dict[operation_name].copy().items()
        }

    def log_all(
        self, print_log: bool = True, show_straggler: bool = False, return_dict: bool = False
    ) -> dict[str, Any] | None:
        """Log (rank 0, ``print_log``) and/or return the summary of every logged op.

        ``show_straggler=True`` adds, per op and size, the latency of the fastest rank and
        the time lost waiting for slower ones; it runs an all-reduce, so call it on every
        rank. ``return_dict=True`` returns ``{"summary", "straggler_analysis", "metadata"}``.
        """
        snapshot = self.comms_dict.copy()
        summary = {
            name: {size: _size_summary(size, entry) for size, entry in sorted(sizes.items())}
            for name, sizes in snapshot.items()
        }
        straggler = _straggler_analysis(snapshot) if show_straggler else None
        if print_log:
            log_dist(_format_summary(summary, straggler))
        if not return_dict:
            return None
        import torch.distributed as dist

        initialized = dist.is_available() and dist.is_initialized()
        return {
            "summary": summary,
            "straggler_analysis": straggler,
            "metadata": {
                "world_size": dist.get_world_size() if initialized else 1,
                "rank": dist.get_rank() if initialized else 0,
                "timestamp": datetime.now().isoformat(),
            },
        }


def _size_summary(msg_size: int, entry: list[Any]) -> dict[str, Any]:
    count, latencies, algbws, busbws = entry
    return {
        "count": count,
        "total_latency_ms": sum(latencies),
        "avg_latency_ms": trim_mean(latencies, 0.1),
        "tput_avg_gbps": trim_mean(algbws, 0.1),
        "busbw_avg_gbps": trim_mean(busbws, 0.1),
        "msg_size_bytes": msg_size,
        "msg_size_str": convert_size(msg_size),
    }


def _straggler_analysis(snapshot: dict[str, dict[int, list[Any]]]) -> dict[str, Any]:
    """Per op and size: this rank's latencies against the minimum over ranks (all-reduce)."""
    import torch
    import torch.distributed as dist

    initialized = dist.is_available() and dist.is_initialized()
    device = "cpu"
    if initialized and dist.get_backend() == "nccl":
        device = f"cuda:{torch.cuda.current_device()}"
    result: dict[str, Any] = {}
    for name, sizes in snapshot.items():
        result[name] = {}
        for size, entry in sorted(sizes.items()):
            lats = torch.tensor(entry[1], dtype=torch.float64, device=device)
            min_lats = lats.clone()
            if initialized:
                dist.all_reduce(min_lats, op=dist.ReduceOp.MIN)
            lost = (lats - min_lats).tolist()
            result[name][size] = {
                "count": entry[0],
                "total_comm_lat_ms": min_lats.sum().item(),
                "total_straggler_ms": sum(lost),
                "avg_comm_lat_ms": trim_mean(min_lats.tolist(), 0.1),
                "avg_straggler_ms": trim_mean(lost, 0.1),
                "msg_size_bytes": size,
                "msg_size_str": convert_size(size),
            }
    return result


def _format_summary(summary: dict[str, Any], straggler: dict[str, Any] | None) -> str:
    """DeepSpeed's fixed-width table (20-character columns)."""
    lines = [
        "".join(
            f"{h: <20}"
            for h in (
                "Comm. Op",
                "Message Size",
                "Count",
                "Total Latency(ms)",
                "Avg Latency(ms)",
                "tput_avg (Gbps)",
                "busbw_avg (Gbps)",
            )
        )
    ]
    for name, sizes in summary.items():
        lines.append(name)
        for s in sizes.values():
            lines.append(
                f"{' ': <20}{s['msg_size_str']: <20}{s['count']: <20}"
                f"{s['total_latency_ms']: <20.2f}{s['avg_latency_ms']: <20.2f}"
                f"{s['tput_avg_gbps']: <20.2f}{s['busbw_avg_gbps']: <20.2f}"
            )
    if straggler is not None:
        lines += ["Breakdown with straggler effect"]
        for name, sizes in straggler.items():
            lines.append(name)
            for s in sizes.values():
                lines.append(
                    f"{' ': <20}{s['msg_size_str']: <20}{s['count']: <20}"
                    f"{s['total_comm_lat_ms']: <20.2f}{s['total_straggler_ms']: <20.2f}"
                    f"{s['avg_comm_lat_ms']: <20.2f}{s['avg_straggler_ms']: <20.2f}"
                )
    return "\n".join(lines)
