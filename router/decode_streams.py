"""The router's side of GenerateMany (proto/pdserve.proto): one long-lived call per decode server,
shared by every request this router process sends there.

With a Generate call per request, every token of every stream is one gRPC message for the router
to read; at a few hundred streams and a millisecond decode step that alone fills a core. On the
shared call one message carries a whole loop step for all of this router's requests, and the
reader hands each request its updates. `open()` returns a `RequestStream`, which reads and cancels
like the Generate call it replaces, so the pairing protocol (router/pairing.py) is unchanged.

A server without GenerateMany (older than it) answers UNIMPLEMENTED: the requests waiting on that
call move to Generate calls of their own, and so does every later request to that server.
If the shared call breaks, every request on it fails as its own Generate call would have (the same
AioRpcError); the next request opens a new call. A server that stops answering without breaking the
call (a hung process: SIGSTOP, a stuck host) is `abandon`ed by the router once its health checks fail
and the call has been silent as long (router/app.py): every request on it fails UNAVAILABLE, saying why.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque

import grpc

from pdserve.proto import pdserve_pb2 as pb
from pdserve.proto import pdserve_pb2_grpc as pb_grpc
from pdserve.router.prefill_attempts import Abandoned

log = logging.getLogger(__name__)


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class DecodeStreams:
    """One decode server's shared GenerateMany call and the requests on it."""

    def __init__(self, channel: grpc.aio.Channel):
        self.stub = pb_grpc.DecodeServiceStub(channel)
        self.streams: dict[str, RequestStream] = {}  # open requests on the current call
        self.unsupported = False  # the server has no GenerateMany: Generate per request
        self._requests: list[pb.GenerateRequest] = []  # to send on the next write
        self._aborts: list[str] = []
        self._wake = asyncio.Event()
        self._runner: asyncio.Task | None = None
        self.last_heard = 0.0  # time.monotonic() of the call's last message (or its opening)

    def open(self, request: pb.GenerateRequest, timeout: float):
        """A call-like stream of `request`'s GenerateResponses (read(), cancel()), ending after
        `timeout` seconds at the latest (DEADLINE_EXCEEDED, as a Generate call's timeout)."""
        if self.unsupported:
            return self.stub.Generate(request, timeout=timeout)
        stream = RequestStream(self, request, timeout)
        self.streams[request.request_id] = stream
        self._requests.append(request)
        self._wake.set()
        if self._runner is None or self._runner.done():
            self._runner = asyncio.create_task(self._run())
        return stream

    def abort(self, rid: str) -> None:
        if self.streams.pop(rid, None) is not None:
            self._aborts.append(rid)
            self._wake.set()

    async def close(self) -> None:
        if self._runner is not None:
            self._runner.cancel()
            try:
                await self._runner
            except asyncio.CancelledError:
                pass

    def abandon(self, why: str) -> int:
        """Fail every request on the call with UNAVAILABLE (`why`) and drop the call (the server hears
        of it as a cancellation, whenever it answers again); how many requests it failed."""
        streams, self.streams = self.streams, {}
        self._requests, self._aborts = [], []
        failure = Abandoned(why)  # (UNAVAILABLE; router/migration.py moves its requests elsewhere)
        for stream in streams.values():
            stream.call_ended(failure)
        if self._runner is not None:
            self._runner.cancel()  # (its teardown finds no request left)
            self._runner = None
        return len(streams)

    async def _run(self) -> None:
        call = self.stub.GenerateMany()
        writer = asyncio.create_task(self._write(call))
        failure: grpc.aio.AioRpcError | None = None
        self.last_heard = time.monotonic()
        try:
            while True:
                response = await call.read()
                self.last_heard = time.monotonic()
                if response is grpc.aio.EOF:
                    break
                self._dispatch(response)
        except grpc.aio.AioRpcError as e:
            failure = e
        finally:
            writer.cancel()
            call.cancel()
            if failure is not None and failure.code() == grpc.StatusCode.UNIMPLEMENTED:
                log.info("decode server has no GenerateMany: a Generate call per request")
                self.unsupported = True
            # No await from here on: no request can join the call being torn down.
            streams, self.streams = self.streams, {}
            self._requests, self._aborts = [], []
            for stream in streams.values():
                stream.call_ended(failure)

    def _dispatch(self, response: pb.GenerateManyResponse) -> None:
        """Hand each request its news, in Generate order: destinations, the token columns, then
        the rest (chunks with logprobs, finishes, errors). A request we aborted meanwhile is skipped."""
        later = []
        for update in response.updates:
            if update.response.WhichOneof("response") != "destination":
                later.append(update)
            elif (stream := self.streams.get(update.request_id)) is not None:
                stream.deliver(update.response)
        columns = response.tokens
        if columns.request_ids:
            token_ids, start = list(columns.token_ids), 0
            for rid, index, count in zip(columns.request_ids, columns.indices, columns.counts):
                stream = self.streams.get(rid)
                if stream is not None:
                    stream.deliver(ColumnTokens(index, token_ids[start : start + count]))
                start += count
        for update in later:
            if (stream := self.streams.get(update.request_id)) is not None:
                stream.deliver(update.response)

    async def _write(self, call) -> None:
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                message = pb.GenerateManyRequest(requests=self._requests, abort_request_ids=self._aborts)
                self._requests, self._aborts = [], []
                await call.write(message)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            pass  # the call broke: the reader sees why


class ColumnTokens:
    """A request's tokens from the call's token columns, read as the GenerateResponse carrying
    them would be (`WhichOneof`, `.tokens.index / .token_ids / .logprobs`): the hot path, once per
    request per decode step, without building two protobuf messages for it."""

    __slots__ = ("index", "token_ids", "logprobs")

    def __init__(self, index: int, token_ids: list[int]):
        self.index, self.token_ids, self.logprobs = index, token_ids, []

    @property
    def tokens(self) -> "ColumnTokens":
        return self

    def WhichOneof(self, oneof: str) -> str:  # noqa: N802 - protobuf's name
        return "tokens"


def _is_last(response: pb.GenerateResponse) -> bool:
    return response.WhichOneof("response") in ("finish", "error")


class RequestStream:
    """One request's updates on the shared call; reads like a Generate call."""

    def __init__(self, owner: DecodeStreams, request: pb.GenerateRequest, timeout: float):
        self.owner, self.request = owner, request
        self.inbox: deque[pb.GenerateResponse] = deque()
        self.ended = False  # its finish or error arrived, or it was cancelled, or the call ended
        self.failure: grpc.aio.AioRpcError | None = None
        self.fallback = None  # its own Generate call, once the server turned out to lack GenerateMany
        self._waiter: asyncio.Future | None = None
        loop = asyncio.get_running_loop()
        self._deadline = loop.time() + timeout
        self._timer = loop.call_at(self._deadline, self._timed_out)

    def deliver(self, response: pb.GenerateResponse) -> None:
        self.inbox.append(response)
        if _is_last(response):
            self._end()
            self.owner.streams.pop(self.request.request_id, None)
        self._wake()

    def call_ended(self, failure: grpc.aio.AioRpcError | None) -> None:
        """The shared call is over (`failure`: why; None: the server closed it)."""
        if failure is not None and failure.code() == grpc.StatusCode.UNIMPLEMENTED:
            left = self._deadline - asyncio.get_running_loop().time()
            self.fallback = self.owner.stub.Generate(self.request, timeout=max(left, 0.001))
        else:
            self.failure = failure
        self._end()
        self._wake()

    async def read(self):
        """The next response (contiguous token chunks queued behind each other come as one), or
        grpc.aio.EOF once the stream is over; raises the call's AioRpcError if it broke."""
        while self.fallback is None and not self.inbox:
            if self.ended:
                if self.failure is not None:
                    raise self.failure
                return grpc.aio.EOF
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        if self.fallback is not None:
            return await self.fallback.read()
        response = self.inbox.popleft()
        if response.WhichOneof("response") == "tokens":
            chunk = response.tokens
            while self.inbox and self.inbox[0].WhichOneof("response") == "tokens":
                following = self.inbox[0].tokens
                if following.index != chunk.index + len(chunk.token_ids):
                    break
                chunk.token_ids.extend(following.token_ids)
                chunk.logprobs.extend(following.logprobs)
                self.inbox.popleft()
        return response

    def cancel(self) -> None:
        """Stop: the server frees the request (a no-op once it ended)."""
        if self.fallback is not None:
            self.fallback.cancel()
        if not self.ended:
            self.owner.abort(self.request.request_id)
            self._end()
            self._wake()

    def _timed_out(self) -> None:
        if not self.ended:
            self.owner.abort(self.request.request_id)
            self.failure = rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
            self._end()
            self._wake()

    def _end(self) -> None:
        self.ended = True
        self._timer.cancel()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
