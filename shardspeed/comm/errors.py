"""Errors a rank raises when collectives hang, fail or diverge, with a report to act on.

* :class:`CollectiveTimeoutError`: a collective (or its ``Work.wait()``) hit the process
  group's timeout. The message names this rank, the collective (op, sizes, group), the
  module/phase it served (the tag of :func:`~shardspeed.comm.set_current_tag`) and this
  rank's last collectives.
* :class:`CollectiveError`: a collective failed otherwise in the backend (a peer crashed,
  the group was broken by an earlier failure); same report.
* :class:`CollectiveMismatchError`: the collective-sequence check found that ranks issued
  different collectives (see :mod:`shardspeed.comm.sequence_check`).

Before building the first two, the ranks that saw the failure agree through the
rendezvous store on the rank at fault (:mod:`shardspeed.comm.blame`); the report's
``blame:`` line names it and ``error.blamed_rank`` holds it (None: nobody singled out).

The first two subclass ``torch.distributed.DistBackendError`` (a ``RuntimeError``), so
code that caught the backend's error still catches them.
"""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from shardspeed.comm.blame import after_report, agree
from shardspeed.comm.sequence import dtype_name, format_ranks, group_ranks

LAST_OPS_IN_REPORT = 8

_AFTER_FAILURE = re.compile(r"pair closure|aborted|has been destroyed|already failed", re.I)
_TIMEOUT = re.compile(r"timed out|timeout|failed to pass monitoredbarrier|watchdog", re.I)
_PEER = re.compile(
    r"connection (closed|reset|refused)|broken pipe|remote (worker|process)|nccl (error|communicator)",
    re.I,
)


class CollectiveError(dist.DistBackendError):
    """A collective failed in the backend; the message is this rank's report."""


class CollectiveTimeoutError(CollectiveError):
    """A collective did not complete within the process group's timeout."""


class CollectiveMismatchError(RuntimeError):
    """Ranks issued different collective sequences (found by the sequence check)."""


def _classify(exc: BaseException) -> type[CollectiveError] | None:
    if isinstance(exc, CollectiveError):
        return None  # already reported (a wrapper calling a wrapper)
    text = str(exc)
    if _AFTER_FAILURE.search(text):
        return CollectiveError
    if _TIMEOUT.search(text):
        return CollectiveTimeoutError
    if _PEER.search(text) or isinstance(exc, dist.DistError):
        return CollectiveError
    return None  # an argument error or similar: not ours to explain


def describe_entry(entry: tuple[Any, ...]) -> str:
    """One recent-ops entry ``(seq, op, group, numel, dtype, tag, async_op)`` as text."""
    seq, op, group, numel, dtype, tag, async_op = entry
    mode = " async" if async_op else ""
    where = f" module/phase={tag!r}" if tag else " module/phase=<untagged>"
    return (
        f"#{seq} {op}{mode} numel={numel} dtype={dtype_name(dtype)} "
        f"group={format_ranks(group_ranks(group))}{where}"
    )


def _timeout_text(group: Any, message: str) -> str:
    from shardspeed.comm.backend import group_timeout

    timeout = group_timeout(group)
    if timeout is not None:
        return f"the process-group timeout ({_fmt_td(timeout)})"
    found = re.search(r"(\d+)\s*ms", message)
    if found:
        return f"the process-group timeout ({int(found.group(1)) / 1000:g} s)"
    return "the process-group timeout"


def _fmt_td(value: timedelta) -> str:
    seconds = value.total_seconds()
    return f"{seconds:g} s" if seconds < 120 else f"{seconds / 60:g} min"


def collective_failure(
    entry: tuple[Any, ...] | None,
    exc: BaseException,
    recent: list[tuple[Any, ...]],
    *,
    waited: bool,
) -> CollectiveError | None:
    """The error to raise for ``exc`` raised by the collective ``entry`` (None: re-raise ``exc``).

    ``recent`` is this rank's ring buffer (oldest first); ``waited`` says the failure came
    from ``Work.wait()`` of an asynchronous collective rather than from issuing it.
    """
    kind = _classify(exc)
    if kind is None or entry is None:
        return None
    seq, op, group, _numel, _dtype, tag, _async = entry
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    ranks = format_ranks(group_ranks(group))
    how = "wait() on " if waited else ""
    if kind is CollectiveTimeoutError:
        after = _timeout_text(group, str(exc))
        head = f"rank {rank} (of {world}): {how}{op} timed out after {after}"
        hint = (
            f"Another rank of group {ranks} did not reach this collective in time: it is "
            "stuck elsewhere, crashed, is doing slow work alone (e.g. rank 0 writing a "
            "checkpoint), or took a different code path. Compare with the other ranks' "
            "reports (every rank that times out raises one); enable the collective_check "
            "config block to find where rank sequences diverge; if a rank is just slow, "
            "raise the timeout (init_distributed(timeout=...), SHARDSPEED_COMM_TIMEOUT in "
            "seconds, or DEEPSPEED_TIMEOUT in minutes)."
        )
    else:
        head = f"rank {rank} (of {world}): {how}{op} failed in the communication backend"
        hint = (
            f"A peer of group {ranks} probably crashed or an earlier collective on this "
            "group failed (after a timeout the group cannot be used again). Look for the "
            "first error on any rank: its report names the collective that failed first."
        )
    where = tag if tag else "<untagged: no set_current_tag() was active>"
    from shardspeed.comm.backend import group_timeout

    timeout = group_timeout(group)
    blamed = agree(entry, list(group_ranks(group)), timeout and timeout.total_seconds())
    lines = [
        head,
        *([f"  blame: {blamed.text}"] if blamed is not None else []),
        f"  collective: {describe_entry(entry)}",
        f"  module/phase: {where}",
        f"  last collectives issued by rank {rank} (oldest first; -> marks this one):",
    ]
    tail = recent[-LAST_OPS_IN_REPORT:]
    if all(e[0] != seq for e in tail):
        lines += [f"    -> {describe_entry(entry)}", "       ..."]
    lines += [f"    {'->' if e[0] == seq else '  '} {describe_entry(e)}" for e in tail]
    lines.append(f"  {hint}")
    lines.append(f"  backend error: {str(exc).strip()}")
    error = kind("\n".join(lines))
    error.rank = rank  # type: ignore[attr-defined]
    error.entry = entry  # type: ignore[attr-defined]
    error.blamed_rank = None if blamed is None else blamed.culprit  # type: ignore[attr-defined]
    after_report(str(error))
    return error
