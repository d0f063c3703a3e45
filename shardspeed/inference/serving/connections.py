"""Connection limits for the HTTP server: a header timeout and a cap on open connections.

uvicorn closes idle keep-alive connections (``timeout_keep_alive``) but has no deadline
for a client that opens a connection and sends its request head slowly or never, and
no cap on open sockets: about a thousand such clients ("slowloris") take every file
descriptor and the server stops accepting, ``/health`` included.
:func:`guarded_h11_protocol` returns uvicorn's h11 protocol with both:

* **Header timeout.** The request line and headers must be complete within
  ``header_timeout_s`` of the connection opening (or of the first byte of the next
  request on a kept-alive connection); otherwise the server answers 408 and closes.
* **Connection cap.** Past ``max_connections`` open connections, a new connection
  evicts the oldest one that is not inside a request (waiting for its headers, or idle
  between requests); when every connection is busy the new one is closed at once.
  Stalled sockets therefore never lock out a health check.

The body deadline is the app's (``ServerSettings.body_timeout_s``, a 408 from
:mod:`.json_body`), since only a handler knows when it reads the body.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

from shardspeed.utils.logging import get_logger, warning_once

logger = get_logger(__name__)

# asyncio accepts up to `backlog` connections per wakeup (uvicorn's `backlog`), before
# any of them reaches connection_made, where the cap applies; about 3 such batches can
# be in flight. The default cap leaves 3 * ACCEPT_BATCH descriptors free for them, plus
# _RESERVED_FDS for the process's own files (model shards, logs, pipes): without that
# room accept() hits EMFILE and asyncio stops accepting for a second. The kernel's
# accept queue is set to LISTEN_BACKLOG after startup, so that a burst of connects is
# queued rather than dropped (a dropped SYN costs the client a 1 s retransmit).
ACCEPT_BATCH = 128
LISTEN_BACKLOG = 2048
_RESERVED_FDS = 128


@dataclass(frozen=True)
class ConnectionLimits:
    """How long a client may take to send its request head, and how many may connect."""

    header_timeout_s: float = 10.0
    """Seconds from connecting (or from the first byte of a next request) to the end of
    the request headers; 408 and close after that."""
    keep_alive_timeout_s: float = 5.0
    """Seconds an idle keep-alive connection stays open (uvicorn's ``timeout_keep_alive``)."""
    max_connections: int | None = None
    """Open connections at most; None: the open-file limit less 512 (at least 16)."""

    def __post_init__(self) -> None:
        for name in ("header_timeout_s", "keep_alive_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise ValueError(
                    f"{name}={value!r} is invalid: it must be a number of seconds > 0."
                )
        n = self.max_connections
        if n is not None and (not isinstance(n, int) or n < 1):
            raise ValueError(f"max_connections={n!r} is invalid: it must be an int >= 1 or None.")

    def resolved_max_connections(self) -> int:
        return self.max_connections or default_max_connections()


def default_max_connections() -> int:
    """The soft open-file limit less room for accepts in flight and the process's own
    files (512 descriptors), at least 16."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):
        return 1024
    if soft == resource.RLIM_INFINITY:
        return 65536
    return max(16, soft - _RESERVED_FDS - 3 * ACCEPT_BATCH)


def _timeout_response(header_timeout_s: float) -> bytes:
    body = json.dumps(
        {
            "error": {
                "message": f"the request headers did not arrive within {header_timeout_s:g} s",
                "type": "invalid_request_error",
                "param": None,
                "code": "request_timeout",
            }
        }
    ).encode()
    head = (
        "HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
        f"connection: close\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def guarded_h11_protocol(limits: ConnectionLimits) -> type[asyncio.Protocol]:
    """uvicorn's ``H11Protocol`` with the header timeout and connection cap of ``limits``
    (pass it as ``uvicorn.Config(http=...)``)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    max_connections = limits.resolved_max_connections()
    header_timeout_s = limits.header_timeout_s
    timeout_response = _timeout_response(header_timeout_s)

    class GuardedH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None
        _head_bytes = 0  # bytes received of a request head that is not complete yet
        _opened_at = 0.0

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._opened_at = time.monotonic()
            self._arm_header_timer()
            if _num_open(self.connections) > max_connections:
                self._make_room()

        def data_received(self, data: bytes) -> None:
            if not self._in_request():
                self._head_bytes += len(data)
                self._arm_header_timer()
            super().data_received(data)
            if self._in_request():
                self._head_bytes = 0
                self._cancel_header_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_header_timer()
            super().connection_lost(exc)

        # ---- helpers ----------------------------------------------------------------------

        def _in_request(self) -> bool:
            """True from a request's complete headers until its response is sent."""
            return self.cycle is not None and not self.cycle.response_complete

        def _arm_header_timer(self) -> None:
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(header_timeout_s, self._header_timeout)

        def _cancel_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _header_timeout(self) -> None:
            self._header_timer = None
            if self._in_request() or self.transport.is_closing():
                return
            if self._head_bytes:
                self.transport.write(timeout_response)
            self.transport.close()

        def _make_room(self) -> None:
            idle = [
                c
                for c in self.connections
                if c is not self
                and isinstance(c, GuardedH11Protocol)
                and not c._in_request()
                and not c.transport.is_closing()
            ]
            if not idle:
                warning_once(
                    f"{max_connections} connections are open and all are busy; refusing new "
                    "ones (raise max_connections / --max-connections or the open-file limit)",
                    __name__,
                )
                self.transport.close()
                return
            warning_once(
                f"{max_connections} connections are open; closing the oldest idle ones to "
                "admit new clients",
                __name__,
            )
            min(idle, key=lambda c: c._opened_at).transport.close()

    return GuardedH11Protocol


def _num_open(connections: Any) -> int:
    return sum(1 for c in connections if not c.transport.is_closing())
