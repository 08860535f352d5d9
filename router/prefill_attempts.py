"""A prefill attempt's call (router/pairing.py makes them): the writes of an early PrefillStreamed
call, and the watch over the attempts in flight, by prefill server.

A prefill server that stops answering without breaking its connection (a hung process: SIGSTOP, a
stuck host) would hold its attempts until the decode server gives up the KV reservation or the
request's deadline passes. Once its health checks have failed `--circuit-failures` times in a row,
the router `abandon`s its attempts that have waited at least as long (router/app.py): each fails
UNAVAILABLE (`Abandoned`), saying why, and is retried on another prefill server as any failed
attempt is (it has produced no token), or fails the request when none is left.

The attempts are this process's (a router process runs one Router on one event loop), kept here
rather than passed along every pairing call.
"""

from __future__ import annotations

import asyncio
import time

import grpc

from pdserve.proto import pdserve_pb2 as pb

# prefill url -> its attempts in flight: the future `abandon` sets to end one -> when it started
_IN_FLIGHT: dict[str, dict[asyncio.Future, float]] = {}


class Abandoned(grpc.aio.AioRpcError):
    """A call the router gave up on: its server stopped answering (a prefill attempt, or a decode
    server's shared call: router/decode_streams.py `abandon`)."""

    def __init__(self, details: str):
        super().__init__(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


async def watched(url: str, answer) -> pb.PrefillResponse:
    """What `answer` (an attempt's call on the prefill server `url`) returns or raises, or Abandoned
    once `abandon` ends the attempt; the call is cancelled then (the server hears of it when it runs)."""
    call = asyncio.ensure_future(answer)
    ended = asyncio.get_running_loop().create_future()
    attempts = _IN_FLIGHT.setdefault(url, {})
    attempts[ended] = time.monotonic()
    try:
        await asyncio.wait((call, ended), return_when=asyncio.FIRST_COMPLETED)
        if call.done():
            return call.result()
        raise ended.result()
    finally:
        call.cancel()
        del attempts[ended]
        if not attempts:
            del _IN_FLIGHT[url]


def abandon(url: str, waited: float, why: str) -> int:
    """End the attempts on `url` that have waited `waited` seconds or more, with Abandoned(`why`);
    how many it ended."""
    now, ended = time.monotonic(), 0
    for attempt, started in _IN_FLIGHT.get(url, {}).items():
        if now - started >= waited and not attempt.done():
            attempt.set_result(Abandoned(f"{why}; the attempt waited {now - started:.1f}s"))
            ended += 1
    return ended


async def write_quietly(call, message: pb.PrefillRequest) -> None:
    """Send on a PrefillStreamed call; a call that already ended is reported when its answer is read."""
    try:
        await call.write(message)
    except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
        pass


async def answer_of(call, destination: pb.KVDestination) -> pb.PrefillResponse:
    """Send the destination on an early PrefillStreamed call and read its answer."""
    await write_quietly(call, pb.PrefillRequest(destination=destination))
    try:
        await call.done_writing()
    except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
        pass
    return await call
