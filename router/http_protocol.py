"""The router's HTTP connections: uvicorn's own protocol (httptools, or h11) with the two guards uvicorn
lacks, so that idle or slow connections cannot pile up in a router process.

- **Header-read timeout.** A connection whose request head is not complete within --header-timeout
  seconds gets 408 and is closed. The clock starts when the connection is accepted, and on a kept-alive
  connection at the first byte of its next request (before that byte, uvicorn's keep-alive timeout
  closes an idle one); it stops once the head is complete (uvicorn has started its request). A body
  that comes slowly is the request's business, not this timer's.
- **Connection cap.** A connection accepted while the process already holds --max-connections-per-worker
  gets 503 with Retry-After and is closed before anything of it is read. uvicorn's limit_concurrency
  counts connections and running requests alike and answers 503 (without Retry-After) only once a
  request head has come in: a connection that sends nothing, or trickles, holds its place meanwhile.

Either way the connection is handed to `Answered`, which writes the answer and lingers (below). The
metric pdserve_router_connections_closed_total{reason} counts both (router/metrics.py).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import resource
import time
from collections.abc import Callable
from http import HTTPStatus

from pdserve.common.openai.api import OpenAIError
from pdserve.router.config import RouterConfig

log = logging.getLogger(__name__)

DEFAULT_MAX_CONNECTIONS = 4096  # --max-connections-per-worker 0, where the open-file limit allows it
FD_RESERVE = 256  # files the process keeps for itself: gRPC channels, the tokenizer, logs, lingering answers
LINGER_S = 2.0  # how long an answered connection is read (and dropped) before it is closed
RETRY_AFTER_S = 1  # what a client past the cap is told to wait: connections come and go quickly
WARN_EVERY_S = 10.0

HEADER_TIMEOUT = "header_timeout"  # the reasons, as the metric's label
OVER_CAP = "over_cap"
REASONS = (HEADER_TIMEOUT, OVER_CAP)


class Guards:
    """One router process's guards: their limits, and the tally of what they closed (a metric, a warning)."""

    def __init__(self, header_timeout_s: float, max_connections: int, count: Callable[[str], None] = lambda r: None):
        self.header_timeout_s = header_timeout_s  # a request head must be complete within this
        self.max_connections = max_connections  # connections the process serves at once
        self.count = count  # told the reason each time a guard closes a connection
        self.warned = 0.0

    @classmethod
    def from_config(cls, config: RouterConfig, count: Callable[[str], None]) -> Guards:
        """The guards the flags ask for (--max-connections-per-worker 0 resolved); ValueError for a bad flag."""
        if not config.header_timeout > 0:
            raise ValueError(f"--header-timeout must be > 0, got {config.header_timeout}")
        if config.max_connections_per_worker < 0:
            raise ValueError(
                "--max-connections-per-worker must be >= 0 (0: from the open-file limit), "
                f"got {config.max_connections_per_worker}"
            )
        return cls(config.header_timeout, config.max_connections_per_worker or default_max_connections(), count)

    def closed(self, reason: str) -> None:
        self.count(reason)
        now = time.monotonic()
        if reason == OVER_CAP and now - self.warned > WARN_EVERY_S:
            self.warned = now
            log.warning("connections past --max-connections-per-worker (%d) are answered 503", self.max_connections)


def default_max_connections() -> int:
    """DEFAULT_MAX_CONNECTIONS, or fewer where the open-file limit (`ulimit -n`, less FD_RESERVE) is lower:
    past that limit accept() fails and the client hears nothing, where under the cap it gets a 503."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return DEFAULT_MAX_CONNECTIONS
    return max(64, min(DEFAULT_MAX_CONNECTIONS, soft - FD_RESERVE))


def guarded_protocol(http: str, guards: Guards) -> Callable[..., asyncio.Protocol]:
    """uvicorn's `http` protocol ("httptools" or "h11") with the guards: what uvicorn.Config takes as http=."""
    if http == "httptools":
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
    else:
        from uvicorn.protocols.http.h11_impl import H11Protocol as base
    guarded = type(f"Guarded{base.__name__}", (Guarded, base), {})
    return functools.partial(guarded, guards=guards)


def answer(status: int, code: str, message: str, headers: str = "") -> bytes:
    """A whole HTTP/1.1 answer with OpenAI's error body, which closes the connection."""
    body = json.dumps(OpenAIError(message, status, code=code).to_body()).encode()
    head = (
        f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n{headers}\r\n"
    )
    return head.encode() + body


class Guarded:
    """Mixed in before uvicorn's protocol class (guarded_protocol): the header timer and the cap.

    It relies on what both of uvicorn's protocols have: `connections` (the process's, shared),
    `transport`, `cycle` (the latest request's; None before the first), `_unset_keepalive_if_required`.
    """

    def __init__(self, *args, guards: Guards, **kwargs):
        super().__init__(*args, **kwargs)
        self.guards = guards
        self.head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:
        if len(self.connections) >= self.guards.max_connections:
            self.guards.closed(OVER_CAP)
            Answered.take_over(transport, self.over_cap_answer())
            return  # never one of uvicorn's connections
        super().connection_made(transport)
        self.start_head_timer()

    def data_received(self, data: bytes) -> None:
        cycle = self.cycle
        super().data_received(data)
        if self.cycle is not cycle:  # a head came in whole: uvicorn started its request
            self.stop_head_timer()
        elif self.head_timer is None and (cycle is None or cycle.response_complete):
            self.start_head_timer()  # the first bytes of a next request (or of what follows an answer)

    def connection_lost(self, exc: Exception | None) -> None:
        self.stop_head_timer()
        super().connection_lost(exc)

    def start_head_timer(self) -> None:
        if not self.transport.is_closing():
            self.head_timer = self.loop.call_later(self.guards.header_timeout_s, self.head_timed_out)

    def stop_head_timer(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def head_timed_out(self) -> None:
        self.head_timer = None
        if self.transport.is_closing() or self.transport.get_protocol() is not self:  # closed, or a websocket
            return
        # NOTE: `Answered` owns the transport from here: uvicorn's connection_lost will not run, so
        # what it would undo is undone now (no request of this connection runs: its head never came).
        self.connections.discard(self)
        self._unset_keepalive_if_required()
        self.guards.closed(HEADER_TIMEOUT)
        message = f"the request head did not come within {self.guards.header_timeout_s:g} s (--header-timeout)"
        Answered.take_over(self.transport, answer(408, "header_timeout", message))

    def over_cap_answer(self) -> bytes:
        message = (
            f"this router process serves {self.guards.max_connections} connections already "
            "(--max-connections-per-worker); retry later"
        )
        return answer(503, "too_many_connections", message, f"retry-after: {RETRY_AFTER_S}\r\n")


class Answered(asyncio.Protocol):
    """A connection the guards answered: the answer is written, the sending side closed (FIN), and what the
    client still sends is read and dropped until it closes its side, or LINGER_S at most.

    NOTE: closing a socket that has unread input sends RST, and the client's kernel may then drop the
    answer before the client reads it ("connection reset" instead of a 503): a client past the cap has
    usually sent its request by the time the answer is out."""

    def __init__(self, transport: asyncio.Transport):
        self.transport = transport
        self.closer = asyncio.get_running_loop().call_later(LINGER_S, transport.close)

    @classmethod
    def take_over(cls, transport: asyncio.Transport, reply: bytes) -> None:
        transport.set_protocol(cls(transport))
        transport.write(reply)
        if not transport.can_write_eof():  # TLS: no half-close
            transport.close()
            return
        transport.write_eof()
        if not transport.is_reading():
            transport.resume_reading()  # uvicorn may have paused it (a body past its buffer)

    def data_received(self, data: bytes) -> None:
        pass

    def connection_lost(self, exc: Exception | None) -> None:
        self.closer.cancel()
