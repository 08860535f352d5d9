"""GenerateMany: every request of one caller (a router process) on one long-lived gRPC call.

Generate costs one gRPC message per request per loop step; at a few hundred running requests and
a step of a millisecond that is more messages than a Python frontend or router can move. Here the
scheduler's messages for all of the call's requests land on one queue, and each response carries
everything queued since the last one: one message per step, or fewer when the caller lags, with
each request's contiguous token chunks merged. Per request the order and the content are
Generate's (decode/responses.py); so are the deadline and the abort when the caller goes away.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from pdserve.common.errors import ErrorCode
from pdserve.common.serving import ipc
from pdserve.decode.responses import DEADLINE_PASSED, is_last, merged_tokens, new_request, response_of
from pdserve.proto import pdserve_pb2 as pb


@dataclass
class Answered:
    """An answer the frontend gives itself (a refused request): sent whatever the request's state."""

    rid: str
    response: pb.GenerateResponse


@dataclass
class Expired:
    """`rid`'s deadline passed (its timer fired)."""

    rid: str


_CALLER_DONE = object()  # the caller half-closed its side


class ManyRequests:
    """The requests of one GenerateMany call and the queue their messages arrive on."""

    def __init__(self, servicer):
        self.servicer = servicer
        self.bridge = servicer.bridge
        self.queue: asyncio.Queue = asyncio.Queue()
        self.live: dict[str, asyncio.TimerHandle | None] = {}  # request id -> its deadline timer
        self.caller_done = False

    async def admit(self, request: pb.GenerateRequest) -> None:
        rid = request.request_id
        if not rid:
            self.queue.put_nowait(
                Answered(rid, refusal(ErrorCode.INVALID_REQUEST, "GenerateMany requests need a request_id"))
            )
            return
        if self.servicer.draining:
            self.queue.put_nowait(Answered(rid, refusal(ErrorCode.OVERLOADED, "the server is draining")))
            return
        try:
            self.bridge.subscribe(rid, self.queue, request.trace_context)
        except ValueError as e:  # in flight already (on this call or another): not ours to end
            self.queue.put_nowait(Answered(rid, refusal(ErrorCode.INVALID_REQUEST, str(e))))
            return
        self.live[rid] = None
        if request.HasField("deadline_unix_s"):
            delay = max(request.deadline_unix_s - time.time(), 0.0)
            self.live[rid] = asyncio.get_running_loop().call_later(delay, self.queue.put_nowait, Expired(rid))
        await self.bridge.send(new_request(rid, request))

    async def abort(self, rid: str) -> None:
        """Free `rid` (if it is still running on this call); nothing more is sent about it."""
        if rid in self.live:
            self.end(rid)
            await self.bridge.send(ipc.Abort(rid))

    def end(self, rid: str) -> None:
        timer = self.live.pop(rid)
        if timer is not None:
            timer.cancel()
        self.bridge.unsubscribe(rid)  # what the scheduler still sends about it is dropped

    async def read_caller(self, request_iterator) -> None:
        try:
            async for message in request_iterator:
                for rid in message.abort_request_ids:
                    await self.abort(rid)
                for request in message.requests:
                    await self.admit(request)
        finally:
            self.caller_done = True
            self.queue.put_nowait(_CALLER_DONE)

    async def next_response(self) -> tuple[pb.GenerateManyResponse, list[str]]:
        """Wait for news; return everything queued by then as one response (token chunks merged
        per request, those without logprobs in columns) and the requests whose deadline passed
        (to abort in the scheduler)."""
        items = [await self.queue.get()]
        while not self.queue.empty():
            items.append(self.queue.get_nowait())
        out: list[list] = []  # [rid, message]: updates, in arrival order
        last_tokens: dict[str, list] = {}  # rid -> its entry in `out` if that entry is tokens
        columns: dict[str, ipc.Tokens] = {}  # rid -> its tokens without logprobs, merged
        expired = []
        for item in items:
            if item is _CALLER_DONE:
                continue
            if isinstance(item, Answered):
                out.append([item.rid, item.response])
                continue
            rid = item.rid
            if rid not in self.live:
                continue  # aborted or expired: what was queued before that is stale
            if isinstance(item, ipc.Tokens):
                if not item.logprobs:
                    held = columns.get(rid)
                    merged = item if held is None else merged_tokens(held, item)
                    if merged is not None:  # (always: the loop sends each request's tokens in order)
                        columns[rid] = merged
                        continue
                entry = last_tokens.get(rid)
                merged = None if entry is None else merged_tokens(entry[1], item)
                if merged is not None:
                    entry[1] = merged
                else:
                    last_tokens[rid] = [rid, item]
                    out.append(last_tokens[rid])
                continue
            last_tokens.pop(rid, None)
            if isinstance(item, Expired):
                self.end(rid)
                expired.append(rid)
                out.append([rid, pb.GenerateResponse(error=DEADLINE_PASSED)])
                continue
            out.append([rid, item])
            if is_last(item):
                self.end(rid)
        ready = self.servicer.ready
        response = pb.GenerateManyResponse(
            updates=[
                pb.RequestUpdate(
                    request_id=rid, response=msg if isinstance(msg, pb.GenerateResponse) else response_of(msg, ready)
                )
                for rid, msg in out
            ]
        )
        if columns:
            chunks = columns.values()
            response.tokens.request_ids.extend(columns)
            response.tokens.indices.extend([c.index for c in chunks])
            response.tokens.counts.extend([len(c.token_ids) for c in chunks])
            response.tokens.token_ids.extend([t for c in chunks for t in c.token_ids])
        return response, expired


def refusal(code: ErrorCode, message: str) -> pb.GenerateResponse:
    return pb.GenerateResponse(error=pb.Error(code=pb.Error.Code.Value(code.value), message=message))


async def generate_many(servicer, request_iterator):
    """The GenerateMany stream of `servicer` (a DecodeServicer): responses until the caller has
    half-closed and its last request ended; on any exit, what is still running is aborted."""
    many = ManyRequests(servicer)
    reader = asyncio.create_task(many.read_caller(request_iterator))
    try:
        while not (many.caller_done and not many.live):
            response, expired = await many.next_response()
            for rid in expired:
                await servicer.bridge.send(ipc.Abort(rid))
            if response.updates or response.tokens.request_ids:
                yield response
    finally:
        reader.cancel()
        for rid in list(many.live):
            await many.abort(rid)
