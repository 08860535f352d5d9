"""The router's pairing protocol (router/pairing.py) against fake servers over real gRPC.

The first prefill attempt starts with the decode server's request, before the decode server has
answered with its pages (PrefillStreamed), and gets the destination on the same call; when that
call fails (a server without PrefillStreamed, or a prefill that stopped waiting for its pages),
the same server is asked again the plain way, and only that attempt counts for its circuit.
"""

from __future__ import annotations

import asyncio
import time

import grpc

from pdserve.common.types import SamplingParams
from pdserve.proto import pdserve_pb2 as pb
from pdserve.proto import pdserve_pb2_grpc as pb_grpc
from pdserve.router.config import RouterConfig
from pdserve.router.pairing import UpstreamError, paired_generate

TIMEOUT_S = 10.0
LAYOUT = pb.KVLayout(page_size=16, num_layers=2, kv_heads=4, head_dim=64, dtype="bfloat16", num_pages=1024)


class FakeDecode(pb_grpc.DecodeServiceServicer):
    """Answers its destination only once `release` is set (by default at once); then two tokens."""

    def __init__(self, release: asyncio.Event | None = None, reject: bool = False, expires_in_s: float = 30.0):
        self.release, self.reject, self.expires_in_s = release, reject, expires_in_s

    async def Generate(self, request, context):
        if self.release is not None:
            await asyncio.wait_for(self.release.wait(), TIMEOUT_S)
        if self.reject:
            yield pb.GenerateResponse(error=pb.Error(code=pb.Error.OVERLOADED, message="full"))
            return
        yield pb.GenerateResponse(
            destination=pb.KVDestination(
                bootstrap_room=request.bootstrap_room,
                decode_agent_name="decode-0",
                decode_agent_metadata=b"meta",
                page_ids=[3, 4],
                layout=LAYOUT,
                expires_unix_s=time.time() + self.expires_in_s,
            )
        )
        yield pb.GenerateResponse(tokens=pb.TokenChunk(token_ids=[8, 9], index=1))
        yield pb.GenerateResponse(
            finish=pb.FinishInfo(reason=pb.FINISH_REASON_LENGTH, usage=pb.Usage(completion_tokens=3))
        )


class PlainPrefill(pb_grpc.PrefillServiceServicer):
    """A prefill server from before PrefillStreamed: the unary Prefill only."""

    def __init__(self):
        self.calls: list[pb.PrefillRequest] = []

    async def Prefill(self, request, context):
        self.calls.append(request)
        return pb.PrefillResponse(first_token_id=7, prompt_tokens=len(request.request.prompt_token_ids))


class StreamedPrefill(PlainPrefill):
    """Records the messages; sets `got_request` on the first, `ended` when the client's side ends
    (it sent all it had, or cancelled: a cancelled call's messages just end, as the real
    server's _forward_destination relies on)."""

    def __init__(self):
        super().__init__()
        self.got_request = asyncio.Event()
        self.ended = asyncio.Event()
        self.messages: list[pb.PrefillRequest] = []

    async def PrefillStreamed(self, request_iterator, context):
        async for message in request_iterator:
            self.messages.append(message)
            self.got_request.set()
        self.ended.set()
        return pb.PrefillResponse(first_token_id=7, prompt_tokens=len(self.messages[0].request.prompt_token_ids))


async def run(decode: FakeDecode, prefill: PlainPrefill, until: asyncio.Event | None = None, servers: int = 1):
    server = grpc.aio.server()
    pb_grpc.add_DecodeServiceServicer_to_server(decode, server)
    pb_grpc.add_PrefillServiceServicer_to_server(prefill, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    reports = []
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:

            def pick_prefill(tried):  # `servers` prefill servers, all of them `prefill`
                return None if len(tried) >= servers else (f"prefill-{len(tried)}", channel)

            stream = paired_generate(
                channel,
                pick_prefill,
                lambda url, ok: reports.append((url, ok)),
                [1, 2, 3],
                SamplingParams(max_new_tokens=3, seed=5),
                RouterConfig(),
            )
            events = []
            try:
                async for event in stream:
                    events.append(event)
            except UpstreamError as e:
                events.append(e)
            if until is not None:  # what the fake server sees after the router is done
                await asyncio.wait_for(until.wait(), TIMEOUT_S)
            return events, reports
    finally:
        await server.stop(None)


def pair(prefill: PlainPrefill, decode: FakeDecode | None = None, until: asyncio.Event | None = None, servers: int = 1):
    """One paired request, in a fresh event loop; by default the decode server answers only once
    the prefill server has the request (a router that waited for the destination before calling
    prefill would time out)."""
    if decode is None:
        decode = FakeDecode(release=prefill.got_request)
    return asyncio.run(asyncio.wait_for(run(decode, prefill, until, servers), 3 * TIMEOUT_S))


def test_prefill_starts_before_the_decode_server_answers():
    prefill = StreamedPrefill()
    events, reports = pair(prefill)
    assert [(e.kind, e.token_ids) for e in events] == [("tokens", [7]), ("tokens", [8, 9]), ("finish", [])]
    first, second = prefill.messages
    assert first.request.prompt_token_ids == [1, 2, 3] and not first.HasField("destination")
    assert list(second.destination.page_ids) == [3, 4] and not second.HasField("request")
    assert second.destination.bootstrap_room == first.request.bootstrap_room
    assert reports == [("prefill-0", True)] and prefill.calls == []


def test_a_prefill_server_without_prefill_streamed_is_asked_the_plain_way():
    prefill = PlainPrefill()
    events, reports = pair(prefill, FakeDecode())
    assert [(e.kind, e.token_ids) for e in events] == [("tokens", [7]), ("tokens", [8, 9]), ("finish", [])]
    [call] = prefill.calls
    assert call.request.prompt_token_ids == [1, 2, 3] and list(call.destination.page_ids) == [3, 4]
    assert reports == [("prefill-0", True)]  # not counted against its circuit


class ImpatientPrefill(StreamedPrefill):
    """Gives up on the destination before it comes, as a prefill server whose decode server is
    slower to reserve pages than --kv-transfer-timeout."""

    async def PrefillStreamed(self, request_iterator, context):
        async for message in request_iterator:
            self.messages.append(message)
            self.got_request.set()
            return pb.PrefillResponse(
                error=pb.Error(code=pb.Error.KV_TRANSFER_FAILED, message="no KV destination came")
            )


def test_an_early_prefill_that_gave_up_is_asked_again_the_plain_way():
    prefill = ImpatientPrefill()
    events, reports = pair(prefill)
    assert [(e.kind, e.token_ids) for e in events] == [("tokens", [7]), ("tokens", [8, 9]), ("finish", [])]
    assert len(prefill.messages) == 1 and len(prefill.calls) == 1
    assert reports == [("prefill-0", True)]


def test_a_decode_refusal_cancels_the_early_prefill():
    prefill = StreamedPrefill()
    events, _ = pair(prefill, FakeDecode(release=prefill.got_request, reject=True), until=prefill.ended)
    [error] = events
    assert isinstance(error, UpstreamError) and error.status == 429 and not error.decode_failed  # full: not a fault
    assert prefill.ended.is_set() and len(prefill.messages) == 1  # the request, never a destination


class LatePrefill(StreamedPrefill):
    """Fails every attempt as a prefill server does that finished too late for its destination."""

    error = pb.Error(code=pb.Error.KV_TRANSFER_TIMEOUT, message="the decode server's KV reservation ended")

    async def PrefillStreamed(self, request_iterator, context):
        async for message in request_iterator:
            self.messages.append(message)
            self.got_request.set()
        return pb.PrefillResponse(error=self.error)

    async def Prefill(self, request, context):
        self.calls.append(request)
        return pb.PrefillResponse(error=self.error)


def test_no_prefill_is_retried_into_an_expired_reservation():
    # Control: with time left, a failed prefill is asked again the plain way, then on the others.
    prefill = LatePrefill()
    [error], reports = pair(prefill, servers=3)
    assert isinstance(error, UpstreamError) and "4 attempt(s)" in str(error)
    assert len(prefill.messages) == 2 and len(prefill.calls) == 3

    # Past the expiry no prefill server would write; another attempt only wastes one.
    prefill = LatePrefill()
    [error], reports = pair(prefill, FakeDecode(release=prefill.got_request, expires_in_s=-1.0), servers=3)
    assert isinstance(error, UpstreamError) and error.status == 503
    assert "not retried" in str(error) and "reservation ended" in str(error)
    assert len(prefill.messages) == 2 and prefill.calls == [] and reports == []


class HangingPrefill(StreamedPrefill):
    """Takes the destination, then never answers: `cancelled` is set when the router gives up."""

    def __init__(self):
        super().__init__()
        self.got_destination = asyncio.Event()
        self.cancelled = asyncio.Event()

    async def PrefillStreamed(self, request_iterator, context):
        try:
            async for message in request_iterator:
                self.messages.append(message)
                self.got_request.set()
                if message.HasField("destination"):
                    self.got_destination.set()
                    await asyncio.sleep(3 * TIMEOUT_S)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise

    Prefill = None  # no second attempt should come


class FailingDecode(FakeDecode):
    """Sends its destination, then fails once the prefill has it: the call breaks, or an error."""

    def __init__(self, prefill: HangingPrefill, broken: bool):
        super().__init__()
        self.prefill, self.broken = prefill, broken

    async def Generate(self, request, context):
        yield pb.GenerateResponse(
            destination=pb.KVDestination(
                bootstrap_room=request.bootstrap_room,
                decode_agent_metadata=b"meta",
                page_ids=[3],
                layout=LAYOUT,
                expires_unix_s=time.time() + 30,
            )
        )
        await asyncio.wait_for(self.prefill.got_destination.wait(), TIMEOUT_S)
        if self.broken:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "decode server went away")
        yield pb.GenerateResponse(error=pb.Error(code=pb.Error.KV_TRANSFER_TIMEOUT, message="KV transfer timed out"))


def test_a_decode_failure_during_the_prefill_cancels_it_and_blames_the_decode_server():
    # Waiting for the prefill's answer first would WRITE into a dead reservation, fail, retry on
    # other prefill servers and open their circuits; the client would wait for all of that.
    for broken in (True, False):
        prefill = HangingPrefill()
        [error], reports = pair(prefill, FailingDecode(prefill, broken), until=prefill.cancelled, servers=3)
        assert isinstance(error, UpstreamError)
        if broken:
            assert error.decode_failed and error.status == 503 and "went away" in str(error)
        else:
            assert error.status == 502 and "KV transfer timed out" in str(error)
        assert prefill.cancelled.is_set() and reports == []  # no prefill server blamed


class LateAnswerPrefill(StreamedPrefill):
    """Answers only once the decode server has streamed every token: the decode stream's first
    chunk reaches the router before the prefill's answer (the KV can land before it)."""

    def __init__(self, decode_done: asyncio.Event):
        super().__init__()
        self.decode_done = decode_done

    async def PrefillStreamed(self, request_iterator, context):
        response = await super().PrefillStreamed(request_iterator, context)
        await asyncio.wait_for(self.decode_done.wait(), TIMEOUT_S)
        return response


class EagerDecode(FakeDecode):
    def __init__(self, release: asyncio.Event, done: asyncio.Event):
        super().__init__(release)
        self.done = done

    async def Generate(self, request, context):
        async for message in super().Generate(request, context):
            yield message
        self.done.set()


def test_decode_tokens_that_come_before_the_prefill_answer_are_kept_in_order():
    decode_done = asyncio.Event()
    prefill = LateAnswerPrefill(decode_done)
    events, _ = pair(prefill, EagerDecode(prefill.got_request, decode_done))
    assert [(e.kind, e.token_ids, e.index) for e in events] == [
        ("tokens", [7], 0),
        ("tokens", [8, 9], 1),
        ("finish", [], 0),
    ]
