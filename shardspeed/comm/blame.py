"""Blame after a distributed failure: which rank stopped participating, and doing what.

When a collective times out or breaks, every rank that sees it only knows its own side
("I waited in #18 all_reduce"). Before raising its report, each such rank runs
:func:`agree`: through the rendezvous store (torchrun's agent hosts it, so it outlives any
worker and a broken process group) it publishes one record and reads its peers'::

    shardspeed_blame/<run id>/<restart>/rank/<r> =
        {"kind": "waiting" | "exception" | "exited", "last": "#17 all_reduce 'tag'", ...}

* ``waiting``: a rank that saw the failure (published on the failure path only);
* ``exception``: a rank whose script died of an uncaught exception (``sys.excepthook``);
* ``exited``: a rank whose interpreter exited without one (``atexit``: ``sys.exit`` or the
  end of the script) -- published only under torchrun, where the store outlives it.

A rank that publishes nothing within the grace period (half the group's timeout, from 1
to :data:`GRACE_S` seconds; ``SHARDSPEED_BLAME_GRACE`` overrides) "stopped responding":
it was killed, hangs, or is busy outside collectives. :func:`verdict` (pure) names the
culprit: an exception first, then an early exit, then a silent rank. Nothing touches the
store while collectives succeed: the hot path keeps its ring-buffer append only.

Under the ``shardspeed`` launcher (``SHARDSPEED_BLAME_DIR`` set) every record is also
written to ``<dir>/rank<r>.json``, from which the launcher prints its one-line summary
(:func:`summarize`), and a SIGTERM that arrives while this rank is agreeing (torchrun
stopping the job because a peer died) waits until the records are written.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

BLAME_DIR_ENV = "SHARDSPEED_BLAME_DIR"
GRACE_ENV = "SHARDSPEED_BLAME_GRACE"  # seconds
GRACE_S = 5.0
STORE_TIMEOUT_S = 3.0
_POLL_S = 0.1


@dataclass
class _BlameState:
    watch_addr: tuple[str, int] | None = None  # the TCPStore the liveness watcher uses
    base: Any = None  # the store the client wraps
    client: Any = None
    rank: int = 0
    published: bool = False  # this rank's record is out (first record wins)
    agreeing: bool = False
    pending_sigterm: bool = False
    installed: bool = False


_STATE = _BlameState()


# ----------------------------------------------------------------- pure parts
def short_entry(entry: tuple[Any, ...] | None) -> str:
    """``#17 all_reduce 'zero2.reduce_grads'`` for a ring-buffer entry (None: none yet)."""
    if entry is None:
        return "none (no collective issued yet)"
    seq, op, _group, _numel, _dtype, tag, _async = entry
    return f"#{seq} {op} {tag!r}" if tag else f"#{seq} {op} (untagged)"


@dataclass(frozen=True)
class Verdict:
    """Who is to blame (``culprit`` None: nobody could be singled out) and the sentence."""

    culprit: int | None
    text: str


def verdict(
    me: int, ranks: list[int], records: Mapping[int, dict[str, Any]], grace_s: float
) -> Verdict:
    """Name the rank at fault among ``ranks`` from the records that arrived (pure).

    Priority: the earliest uncaught exception, then the earliest early exit, then the
    lowest rank that published nothing; else every rank was waiting (no single culprit).
    """
    mine = records.get(me, {})
    waited = mine.get("last", "a collective")
    for kind in ("exception", "exited"):
        found = sorted((r["time"], rank) for rank, r in records.items() if r["kind"] == kind)
        if found:
            rank = found[0][1]
            rec = records[rank]
            if kind == "exception":
                what = f"rank {rank} failed: {rec.get('detail', 'an exception')}"
            else:
                what = f"rank {rank} exited early (sys.exit or end of script)"
            return Verdict(rank, f"{what}; its last collective was {rec.get('last')}")
    behind = [
        rank for rank, r in sorted(records.items()) if r["kind"] == "alive" and r["last"] != waited
    ]
    if behind:
        rank = behind[0]
        also = f" (also elsewhere: ranks {behind[1:]})" if len(behind) > 1 else ""
        return Verdict(
            rank,
            f"rank {rank} stopped participating: it is alive but never joined {waited}, "
            f"which rank {me} was waiting in; its last collective was "
            f"{records[rank]['last']}{also}",
        )
    silent = [rank for rank in ranks if rank not in records]
    if silent:
        also = f" (also silent: ranks {silent[1:]})" if len(silent) > 1 else ""
        return Verdict(
            silent[0],
            f"rank {silent[0]} stopped responding (no report within {grace_s:g} s: killed, "
            f"hung, or busy outside collectives); its last collective was "
            f"{mine.get('prev', 'unknown')} (the last one rank {me} completed with it); it "
            f"never joined {waited}, which rank {me} was waiting in{also}",
        )
    waits = sorted({f"rank {rank} in {rec.get('last')}" for rank, rec in records.items()})
    return Verdict(None, "no rank stopped: every rank reported waiting -- " + "; ".join(waits))


def summarize(records: list[dict[str, Any]]) -> str | None:
    """The launcher's line from the per-rank file records (None: no rank left one).

    Survivors' agreed verdicts come first (most reporters, then earliest), then the
    earliest uncaught exception, then any verdict without a culprit.
    """
    blamed: dict[int, list[dict[str, Any]]] = {}
    for rec in records:
        if rec.get("kind") == "verdict" and rec.get("culprit") is not None:
            blamed.setdefault(int(rec["culprit"]), []).append(rec)
    if blamed:
        culprit, recs = max(blamed.items(), key=lambda kv: (len(kv[1]), -kv[1][0]["time"]))
        reporters = sorted(int(r["rank"]) for r in recs)
        return f"{recs[0]['text']} (reported by rank(s) {reporters})"
    exceptions = sorted(
        (r for r in records if r.get("kind") == "exception"), key=lambda r: r["time"]
    )
    if exceptions:
        rec = exceptions[0]
        return f"rank {rec['rank']} failed: {rec['detail']}; its last collective was {rec['last']}"
    for rec in records:
        if rec.get("kind") == "verdict":
            return f"rank {rec['rank']}: {rec['text']}"
    return None


def read_records(directory: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every ``rank*.json`` record under ``directory`` (unreadable files skipped)."""
    out = []
    for path in sorted(Path(directory).glob("rank*.json")):
        with contextlib.suppress(OSError, ValueError):
            out.append(json.loads(path.read_text()))
    return out


# ----------------------------------------------------------------- store and files
def _grace_s(timeout_s: float | None) -> float:
    """``SHARDSPEED_BLAME_GRACE``, else half the group's timeout within [1, 5] s."""
    with contextlib.suppress(KeyError, ValueError):
        return max(float(os.environ[GRACE_ENV]), 0.0)
    default = GRACE_S if timeout_s is None else timeout_s / 2
    return min(max(default, 1.0), GRACE_S)


def _prefix() -> str:
    run = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    return f"shardspeed_blame/{run}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"


def _default_store() -> Any:
    import torch.distributed as dist

    try:
        return dist.distributed_c10d._get_default_store()  # noqa: SLF001
    except Exception:  # no default group (never made, or destroyed)
        return None


def _env_store() -> Any:
    """A short-timeout client of ``MASTER_ADDR:MASTER_PORT`` (None: unset or unreachable)."""
    import torch.distributed as dist

    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT", "")
    if not addr or not port.isdigit():
        return None
    try:
        return dist.TCPStore(
            addr, int(port), is_master=False, timeout=timedelta(seconds=STORE_TIMEOUT_S),
            wait_for_workers=False,
        )  # fmt: skip
    except Exception:
        return None


def _client() -> Any:
    """The rendezvous store under this job's blame prefix (None: unreachable).

    The default group's store while it exists (its own prefix keeps records of successive
    groups apart: a new group starts with no records), else the one noted last, else a
    client of ``MASTER_ADDR:MASTER_PORT``. Only non-blocking reads are made of it.
    """
    import torch.distributed as dist

    base = _default_store()
    if base is not None and base is not _STATE.base:
        _STATE.base, _STATE.published = base, False
        _STATE.client = dist.PrefixStore(_prefix(), base)
    if _STATE.client is None:
        base = _env_store()
        if base is not None:
            _STATE.base, _STATE.client = base, dist.PrefixStore(_prefix(), base)
    return _STATE.client


def _write_file(record: dict[str, Any]) -> None:
    directory = os.environ.get(BLAME_DIR_ENV)
    if not directory:
        return
    with contextlib.suppress(OSError):
        os.makedirs(directory, exist_ok=True)
        path = Path(directory) / f"rank{record['rank']}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, path)


def publish(kind: str, detail: str = "") -> None:
    """Publish this rank's record (first one wins) to the store and, for a launcher, a file."""
    client = _client()
    if _STATE.published:
        return
    _STATE.published = True
    from shardspeed.comm.logger import recent_entries

    recent = recent_entries()
    record = {
        "rank": _rank(),
        "kind": kind,
        "last": short_entry(recent[-1] if recent else None),
        "detail": detail,
        "time": time.time(),
    }
    if kind == "exception":
        _write_file(record)
    if client is not None:
        with contextlib.suppress(Exception):
            client.set(f"rank/{record['rank']}", json.dumps(record))


def _rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", _STATE.rank))


def _gather(client: Any, ranks: list[int], grace_s: float) -> dict[int, dict[str, Any]]:
    """The records of ``ranks`` that arrive within ``grace_s`` (all of them: sooner).

    A failure record (``rank/<r>``) wins over the watcher's ``alive`` answer.
    """
    raw = _raw_client()
    if raw is not None:
        with contextlib.suppress(Exception):
            raw.set(_prefix() + "request", "1")
    records: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + grace_s
    while True:
        for rank in ranks:
            key = f"rank/{rank}"
            if records.get(rank, {}).get("kind", "alive") != "alive":
                continue
            if client.check([key]):
                records[rank] = json.loads(client.get(key))
            elif raw is not None and rank not in records:
                alive = f"{_prefix()}alive/{rank}"
                if raw.check([alive]):
                    records[rank] = json.loads(raw.get(alive))
        if len(records) == len(ranks) or time.monotonic() >= deadline:
            return records
        time.sleep(_POLL_S)


def _previous_in_group(entry: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """The collective this rank issued on ``entry``'s group just before ``entry``."""
    from shardspeed.comm.logger import recent_entries

    earlier = [e for e in recent_entries() if e[0] < entry[0] and e[2] is entry[2]]
    return earlier[-1] if earlier else None


@contextlib.contextmanager
def _sigterm_deferred() -> Iterator[None]:
    _STATE.agreeing = True
    try:
        yield
    finally:
        _STATE.agreeing = False


def agree(
    entry: tuple[Any, ...], ranks: list[int], timeout_s: float | None = None
) -> Verdict | None:
    """Publish "waiting in ``entry``", read the peers' records of ``ranks``, judge.

    None when the store cannot be reached. Bounded by the grace period (from the group's
    ``timeout_s``, see :func:`_grace_s`) plus store timeouts. Failure path only.
    """
    if len(ranks) < 2:
        return None
    with _sigterm_deferred():
        me = _rank()
        publish("waiting")
        client = _client()
        if client is None:
            return None
        grace_s = _grace_s(timeout_s)
        try:
            records = _gather(client, ranks, grace_s)
        except Exception:
            return None
        if me not in records:  # our own record did not make it
            records[me] = {"kind": "waiting", "last": short_entry(entry), "time": time.time()}
        records[me]["prev"] = short_entry(_previous_in_group(entry))
        result = verdict(me, ranks, records, grace_s)
        _write_file(
            {"rank": me, "kind": "verdict", "culprit": result.culprit, "text": result.text,
             "time": time.time()}
        )  # fmt: skip
    return result


def after_report(report: str) -> None:
    """If torchrun's SIGTERM came while agreeing: print ``report``, then die of it."""
    if not _STATE.pending_sigterm:
        return
    _STATE.pending_sigterm = False
    sys.stderr.write(report + "\n")
    sys.stderr.flush()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


# ----------------------------------------------------------------- liveness watcher
def _tcp_addr(store: Any) -> tuple[str, int] | None:
    import torch.distributed as dist

    while store is not None and not isinstance(store, dist.TCPStore):
        store = getattr(store, "underlying_store", None)
    return None if store is None else (store.host, store.port)


def _raw_client(timeout_s: float = STORE_TIMEOUT_S) -> Any:
    import torch.distributed as dist

    if _STATE.watch_addr is None:
        return None
    host, port = _STATE.watch_addr
    try:
        return dist.TCPStore(
            host, port, is_master=False, timeout=timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )  # fmt: skip
    except Exception:
        return None


def _watch(rank: int) -> None:
    """Thread: block on the store until a peer asks, then say "alive, last in #N" once.

    Costs nothing while collectives succeed (one idle connection, one sleeping thread);
    it answers even while the main thread is stuck (a hang, a blocked collective), so a
    blocked survivor is not mistaken for a dead rank.
    """
    from shardspeed.comm.logger import recent_entries

    client = _raw_client()
    if client is None:
        return
    while True:
        try:
            client.wait([_prefix() + "request"], timedelta(seconds=600))
            break
        except Exception as exc:  # a wait timeout: keep waiting; anything else: stop
            if "timeout" not in str(exc).lower():
                return
    recent = recent_entries()
    record = {"rank": rank, "kind": "alive", "time": time.time()}
    record["last"] = short_entry(recent[-1] if recent else None)
    with contextlib.suppress(Exception):
        client.set(f"{_prefix()}alive/{rank}", json.dumps(record))


# ----------------------------------------------------------------- hooks
def _on_sigterm(signum: int, _frame: object) -> None:
    if _STATE.agreeing:
        _STATE.pending_sigterm = True
        return
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _excepthook(previous: Any) -> Any:
    def hook(exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
        if not issubclass(exc_type, KeyboardInterrupt):
            text = str(exc).strip().splitlines()
            publish("exception", f"{exc_type.__name__}: {text[0] if text else ''}"[:300])
        previous(exc_type, exc, tb)

    return hook


def _at_exit() -> None:
    publish("exited")


def install() -> None:
    """Note the store and install the hooks once (called by ``init_distributed``).

    Under torchrun (whose agent hosts the store, so it outlives this process): the
    uncaught-exception and exit records. Under the
    ``shardspeed`` launcher, on the main thread: a SIGTERM handler that acts as the default
    one except while this rank is agreeing.
    """
    _STATE.rank = _rank()
    _client()  # note this group's store (a new group: no records yet)
    if _STATE.installed:
        return
    _STATE.installed = True
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
        sys.excepthook = _excepthook(sys.excepthook)
        atexit.register(_at_exit)
        _STATE.watch_addr = _tcp_addr(_default_store())
        if _STATE.watch_addr is not None:
            threading.Thread(
                target=_watch, args=(_STATE.rank,), name="shardspeed-blame", daemon=True
            ).start()
    if os.environ.get(BLAME_DIR_ENV) and threading.current_thread() is threading.main_thread():
        if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
            signal.signal(signal.SIGTERM, _on_sigterm)
