"""The router's HTTP connections: uvicorn's own protocol (httptools, or h11) with the guards uvicorn
lacks, so that idle or slow connections cannot pile up in a router process.

- **Header-read timeout.** A connection whose request head is not complete within --header-timeout
  seconds gets 408 and is closed. The clock starts when the connection is accepted, and on a kept-alive
  connection at the first byte of its next request (before that byte, uvicorn's keep-alive timeout
  closes an idle one); it stops once the head is complete (uvicorn has started its request).
- **Body-read timeout.** A request whose body is not complete within --body-timeout seconds of its
  head gets 408 and its connection is closed; the request (reading its body) hears that its client
  is gone. A request that answered without reading its whole body (a 413, say) is not timed.
- **Connection cap.** A connection accepted while the process already holds --max-connections-per-worker
  gets 503 with Retry-After and is closed before anything of it is read. uvicorn's limit_concurrency
  counts connections and running requests alike and answers 503 (without Retry-After) only once a
  request head has come in: a connection that sends nothing, or trickles, holds its place meanwhile.
  Each connection is an open file: `raise_open_file_limit` lifts the process's soft limit to its hard
  one at start (as vLLM does), and the default cap follows the limit.

Every time, the connection is handed to `Answered`, which writes the answer and lingers (below). The
metric pdserve_router_connections_closed_total{reason} counts them (router/metrics.py).
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
NOFILE_CEILING = 1 << 20  # the soft open-file limit asked for when the hard one is unlimited (Linux's nr_open)
FD_RESERVE = 256  # files the process keeps for itself: gRPC channels, the tokenizer, logs, lingering answers
LINGER_S = 2.0  # how long an answered connection is read (and dropped) before it is closed
RETRY_AFTER_S = 1  # what a client past the cap is told to wait: connections come and go quickly
WARN_EVERY_S = 10.0

HEADER_TIMEOUT = "header_timeout"  # the reasons, as the metric's label
BODY_TIMEOUT = "body_timeout"
OVER_CAP = "over_cap"
REASONS = (HEADER_TIMEOUT, BODY_TIMEOUT, OVER_CAP)


class Guards:
    """One router process's guards: their limits, and the tally of what they closed (a metric, a warning)."""

    def __init__(
        self,
        header_timeout_s: float,
        body_timeout_s: float,
        max_connections: int,
        count: Callable[[str], None] = lambda r: None,
    ):
        self.header_timeout_s = header_timeout_s  # a request head must be complete within this
        self.body_timeout_s = body_timeout_s  # and its body within this of the head
        self.max_connections = max_connections  # connections the process serves at once
        self.count = count  # told the reason each time a guard closes a connection
        self.warned = 0.0

    @classmethod
    def from_config(cls, config: RouterConfig, count: Callable[[str], None]) -> Guards:
        """The guards the flags ask for (checked by RouterConfig.check), --max-connections-per-worker 0
        resolved from the open-file limit as it is now (raise_open_file_limit first)."""
        return cls(
            config.header_timeout,
            config.body_timeout,
            config.max_connections_per_worker or default_max_connections(),
            count,
        )

    def closed(self, reason: str) -> None:
        self.count(reason)
        now = time.monotonic()
        if reason == OVER_CAP and now - self.warned > WARN_EVERY_S:
            self.warned = now
            log.warning("connections past --max-connections-per-worker (%d) are answered 503", self.max_connections)


def raise_open_file_limit() -> int:
    """Raise this process's soft open-file limit (`ulimit -n`) to its hard one, as vLLM does: every
    connection is a file, and a soft limit of 1024 (a common default) would cap the connections at 768.
    The soft limit it leaves; a warning when it cannot raise it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = NOFILE_CEILING if hard == resource.RLIM_INFINITY else hard
    if soft == resource.RLIM_INFINITY or soft >= wanted:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    except (ValueError, OSError) as e:
        log.warning(
            "the open-file limit stays at %d (raising it to %d failed: %s); see --max-connections-per-worker",
            soft,
            wanted,
            e,
        )
        return soft
    return wanted


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
    """Mixed in before uvicorn's protocol class (guarded_protocol): the header and body timers, and the cap.

    It relies on what both of uvicorn's protocols have: `connections` (the process's, shared),
    `transport`, `cycle` (the latest request's; None before the first, with `more_body`,
    `response_started`, `response_complete`), `connection_lost`, `_unset_keepalive_if_required`.
    """

    def __init__(self, *args, guards: Guards, **kwargs):
        super().__init__(*args, **kwargs)
        self.guards = guards
        self.head_timer: asyncio.TimerHandle | None = None
        self.body_timer: asyncio.TimerHandle | None = None
        self.body_cycle = None  # the request whose body body_timer times

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
        self.watch_body()

    def connection_lost(self, exc: Exception | None) -> None:
        self.stop_head_timer()
        self.stop_body_timer()
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
        message = f"the request head did not come within {self.guards.header_timeout_s:g} s (--header-timeout)"
        self.hand_over(HEADER_TIMEOUT, answer(408, "header_timeout", message))

    def watch_body(self) -> None:
        """Time the latest request's body from its head until it is whole.

        NOTE: a pipelined request's body (no common client pipelines) is timed from its head too,
        though uvicorn reads it only once the request before it has been answered."""
        cycle = self.cycle
        if cycle is None or not cycle.more_body:
            self.stop_body_timer()
        elif self.body_cycle is not cycle:  # a new request, its body still to come
            self.stop_body_timer()
            self.body_cycle = cycle
            self.body_timer = self.loop.call_later(self.guards.body_timeout_s, self.body_timed_out)

    def stop_body_timer(self) -> None:
        if self.body_timer is not None:
            self.body_timer.cancel()
        self.body_timer, self.body_cycle = None, None

    def body_timed_out(self) -> None:
        cycle, self.body_timer, self.body_cycle = self.body_cycle, None, None
        if cycle is not self.cycle or not cycle.more_body or cycle.response_started or cycle.disconnected:
            return  # whole, or answered without it (a 413): no longer the request's business
        if self.transport.is_closing() or self.transport.get_protocol() is not self:
            return
        message = (
            f"the request body did not come whole within {self.guards.body_timeout_s:g} s of its head (--body-timeout)"
        )
        self.hand_over(BODY_TIMEOUT, answer(408, "body_timeout", message))

    def hand_over(self, reason: str, reply: bytes) -> None:
        """Answer `reply` and close: `Answered` owns the transport from here."""
        self.guards.closed(reason)
        Answered.take_over(self.transport, reply)
        # NOTE: the transport now calls Answered's connection_lost, not uvicorn's: uvicorn's runs here,
        # with an exception, so that it leaves the transport alone. It drops the connection from the
        # process's count, and a request still reading its body hears that its client is gone.
        self.connection_lost(ConnectionAbortedError(reason))
        self._unset_keepalive_if_required()

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
