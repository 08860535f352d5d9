"""GenerateMany: many requests on one call, against a real decode server (decode/generate_many.py)
and, on the router's side (router/decode_streams.py), against fake servers over real gRPC: a
server without GenerateMany, a call that breaks, a request that times out or is cancelled."""

from __future__ import annotations

import asyncio
import random
import time

import grpc
import pytest

from pdserve.proto import pdserve_pb2 as pb
from pdserve.proto import pdserve_pb2_grpc as pb_grpc
from pdserve.router.decode_streams import DecodeStreams
from tests.test_disagg_engines import hf_greedy
from tests.test_pairing import FakeDecode
from tests.test_servers import Server, params, prompts, wait_idle

TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def servers(tiny_models):
    model = tiny_models("llama")
    decode = Server("decode", model, "--max-running-requests", "8")
    prefill = Server("prefill", model)
    try:
        decode.wait_ready()
        prefill.wait_ready()
        yield model, decode, prefill
    finally:
        for s in (decode, prefill):
            s.stop()


def request(
    rid: str, prompt: list[int], max_new: int = 8, deadline_in_s: float = TIMEOUT_S, **kw
) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=rid,
        prompt_token_ids=prompt,
        params=params(max_new, **kw),
        bootstrap_room=random.getrandbits(63),
        deadline_unix_s=time.time() + deadline_in_s,
    )


class Caller:
    """One GenerateMany call: sends batches, reads updates into per-request lists, and prefills
    each request whose destination arrives (unless told to hold it)."""

    def __init__(self, dch, pch, hold=()):
        self.call = pb_grpc.DecodeServiceStub(dch).GenerateMany(timeout=TIMEOUT_S)
        self.prefill = pb_grpc.PrefillServiceStub(pch)
        self.requests: dict[str, pb.GenerateRequest] = {}
        self.updates: dict[str, list[pb.GenerateResponse]] = {}
        self.hold, self.tasks = set(hold), []

    async def send(self, requests=(), aborts=()):
        for r in requests:
            self.requests[r.request_id] = r
        await self.call.write(pb.GenerateManyRequest(requests=list(requests), abort_request_ids=list(aborts)))

    async def read_until(self, done) -> None:
        while not done(self):
            response = await asyncio.wait_for(self.call.read(), TIMEOUT_S)
            assert response is not grpc.aio.EOF
            # A response reads as: destinations, the token columns, the other updates.
            destinations = [u for u in response.updates if u.response.WhichOneof("response") == "destination"]
            columns, start, token_ids = [], 0, list(response.tokens.token_ids)
            for rid, index, count in zip(response.tokens.request_ids, response.tokens.indices, response.tokens.counts):
                chunk = pb.TokenChunk(token_ids=token_ids[start : start + count], index=index)
                columns.append(pb.RequestUpdate(request_id=rid, response=pb.GenerateResponse(tokens=chunk)))
                start += count
            others = [u for u in response.updates if u.response.WhichOneof("response") != "destination"]
            for u in destinations + columns + others:
                self.updates.setdefault(u.request_id, []).append(u.response)
                if u.response.WhichOneof("response") == "destination" and u.request_id not in self.hold:
                    req = pb.PrefillRequest(request=self.requests[u.request_id], destination=u.response.destination)
                    self.tasks.append(asyncio.ensure_future(self.prefill.Prefill(req, timeout=TIMEOUT_S)))

    def ended(self, rid: str) -> bool:
        return bool(self.updates.get(rid)) and self.updates[rid][-1].WhichOneof("response") in ("finish", "error")

    def tokens(self, rid: str) -> list[int]:
        """The request's tokens; asserts the Generate order: destination, contiguous chunks, finish."""
        kinds = [u.WhichOneof("response") for u in self.updates[rid]]
        assert kinds[0] == "destination" and kinds[-1] == "finish" and set(kinds[1:-1]) == {"tokens"}, kinds
        out = []
        for u in self.updates[rid][1:-1]:
            assert u.tokens.index == len(out), "a chunk lost or repeated tokens"
            out += list(u.tokens.token_ids)
        return out


def test_many_requests_on_one_call_match_transformers_and_abort_cleanly(servers):
    model, decode, prefill = servers
    cases = prompts(6, seed=11)
    expected = hf_greedy(model, cases, 8)

    async def main():
        async with grpc.aio.insecure_channel(decode.address) as dch, grpc.aio.insecure_channel(prefill.address) as pch:
            caller = Caller(dch, pch, hold={"held", "late"})
            await caller.send([request(f"r{i}", p) for i, p in enumerate(cases[:4])])
            await caller.send(
                [request(f"r{i}", p) for i, p in enumerate(cases[4:], start=4)]
                + [
                    request("held", cases[0]),
                    request("late", cases[1], deadline_in_s=1.5),
                    request("lp", cases[2], logprobs=1),
                ]
            )  # chunks with logprobs: updates
            await caller.read_until(
                lambda c: all(c.ended(f"r{i}") for i in range(6)) and c.ended("late") and c.ended("lp")
            )
            assert caller.updates["held"][0].WhichOneof("response") == "destination"
            other = Caller(dch, pch)  # an id in flight (on another call) is refused on this one
            await other.send([request("held", cases[0])])
            await other.read_until(lambda c: c.ended("held"))
            assert [u.error.code for u in other.updates["held"]] == [pb.Error.INVALID_REQUEST]
            other.call.cancel()
            await caller.send(aborts=["held"])
            await asyncio.gather(*caller.tasks)
            await caller.call.done_writing()
            # After the half-close the call ends once nothing runs on it; "held" sends nothing more.
            while (response := await asyncio.wait_for(caller.call.read(), TIMEOUT_S)) is not grpc.aio.EOF:
                assert all(u.request_id != "held" for u in response.updates)
            return caller

    caller = asyncio.run(main())
    for i, want in enumerate(expected):
        assert caller.tokens(f"r{i}") == want
    assert caller.tokens("lp") == expected[2]
    assert all(len(u.tokens.logprobs) == len(u.tokens.token_ids) for u in caller.updates["lp"][1:-1])
    late = caller.updates["late"][-1]
    assert late.error.code == pb.Error.ABORTED and "deadline" in late.error.message
    assert len(caller.updates["held"]) == 1
    asyncio.run(wait_idle(decode, prefill))


def test_cancelling_the_call_frees_every_request_on_it(servers):
    model, decode, prefill = servers

    async def main():
        async with grpc.aio.insecure_channel(decode.address) as dch, grpc.aio.insecure_channel(prefill.address) as pch:
            caller = Caller(dch, pch, hold={"a", "b"})
            await caller.send([request("a", [0, 5, 6]), request("b", [0, 7, 8])])
            await caller.read_until(lambda c: "a" in c.updates and "b" in c.updates)
            caller.call.cancel()

    asyncio.run(main())
    asyncio.run(wait_idle(decode, prefill))


# ---- the router's side -----------------------------------------------------------------------


class FakeMany(FakeDecode):
    """GenerateMany that answers each request with a destination, three one-token chunks in separate
    messages and a finish — or, for a request id starting with "silent", nothing; records aborts.
    `break_after` requests: the call fails (UNAVAILABLE) once that many have arrived."""

    def __init__(self, break_after: int = 0):
        super().__init__()
        self.aborted: list[str] = []
        self.break_after = break_after

    async def GenerateMany(self, request_iterator, context):
        seen = 0
        async for message in request_iterator:
            self.aborted += list(message.abort_request_ids)
            for r in message.requests:
                seen += 1
                if self.break_after and seen >= self.break_after:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "going away")
                if r.request_id.startswith("silent"):
                    continue
                rid = r.request_id
                yield pb.GenerateManyResponse(
                    updates=[
                        pb.RequestUpdate(
                            request_id=rid, response=pb.GenerateResponse(destination=pb.KVDestination(page_ids=[1]))
                        )
                    ]
                )
                for i in range(1, 4):
                    yield pb.GenerateManyResponse(
                        updates=[
                            pb.RequestUpdate(
                                request_id=rid,
                                response=pb.GenerateResponse(tokens=pb.TokenChunk(token_ids=[10 + i], index=i)),
                            )
                        ]
                    )
                yield pb.GenerateManyResponse(
                    updates=[
                        pb.RequestUpdate(
                            request_id=rid,
                            response=pb.GenerateResponse(finish=pb.FinishInfo(reason=pb.FINISH_REASON_LENGTH)),
                        )
                    ]
                )


async def serve(servicer):
    server = grpc.aio.server()
    pb_grpc.add_DecodeServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def read_all(stream) -> list[pb.GenerateResponse]:
    out = []
    while (msg := await asyncio.wait_for(stream.read(), TIMEOUT_S)) is not grpc.aio.EOF:
        out.append(msg)
        if msg.WhichOneof("response") in ("finish", "error"):
            break
    return out


def kinds(messages) -> list[str]:
    """The kinds of `messages`, a run of token chunks as one."""
    out = []
    for m in messages:
        kind = m.WhichOneof("response")
        if not (kind == "tokens" and out and out[-1] == "tokens"):
            out.append(kind)
    return out


def test_router_streams_share_one_call_merge_chunks_and_abort_on_cancel():
    async def main():
        servicer = FakeMany()
        server, address = await serve(servicer)
        async with grpc.aio.insecure_channel(address) as channel:
            streams = DecodeStreams(channel)
            a, b = streams.open(request("a", [1]), TIMEOUT_S), streams.open(request("b", [1]), TIMEOUT_S)
            first = await a.read()
            assert first.WhichOneof("response") == "destination"
            while len(a.inbox) < 4:  # let the rest queue up: read() then merges the contiguous chunks
                await asyncio.sleep(0.01)
            merged = await a.read()
            assert list(merged.tokens.token_ids) == [11, 12, 13] and merged.tokens.index == 1
            assert kinds(await read_all(a)) == ["finish"]
            assert kinds(await read_all(b)) == ["destination", "tokens", "finish"]
            silent = streams.open(request("silent-1", [1]), TIMEOUT_S)
            await asyncio.sleep(0.1)
            silent.cancel()
            assert await silent.read() is grpc.aio.EOF
            for _ in range(100):
                if servicer.aborted:
                    break
                await asyncio.sleep(0.02)
            assert servicer.aborted == ["silent-1"] and not streams.unsupported and not streams.streams
            timed = streams.open(request("silent-2", [1]), 0.2)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await read_all(timed)
            assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            await streams.close()
        await server.stop(None)

    asyncio.run(main())


def test_router_falls_back_to_generate_on_a_server_without_generate_many():
    async def main():
        server, address = await serve(FakeDecode())
        async with grpc.aio.insecure_channel(address) as channel:
            streams = DecodeStreams(channel)
            got = await asyncio.gather(*(read_all(streams.open(request(f"x{i}", [1]), TIMEOUT_S)) for i in range(3)))
            assert streams.unsupported
            got.append(await read_all(streams.open(request("later", [1]), TIMEOUT_S)))  # straight to Generate
            await streams.close()
        await server.stop(None)
        return got

    for messages in asyncio.run(main()):
        assert kinds(messages) == ["destination", "tokens", "finish"]


def test_a_broken_shared_call_fails_its_requests_and_the_next_request_opens_a_new_one():
    async def main():
        servicer = FakeMany(break_after=2)
        server, address = await serve(servicer)
        async with grpc.aio.insecure_channel(address) as channel:
            streams = DecodeStreams(channel)
            waiting = streams.open(request("silent-a", [1]), TIMEOUT_S)
            await asyncio.sleep(0.1)
            breaking = streams.open(request("silent-b", [1]), TIMEOUT_S)
            for stream in (waiting, breaking):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await read_all(stream)
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            servicer.break_after = 0
            assert kinds(await read_all(streams.open(request("c", [1]), TIMEOUT_S))) == [
                "destination",
                "tokens",
                "finish",
            ]
            await streams.close()
        await server.stop(None)

    asyncio.run(main())
