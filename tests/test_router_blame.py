"""Circuit breakers blame servers only for server faults.

Each cause of a failed choice is driven through the real Router (its registry, its pairing) against
fake servers over real gRPC, with --circuit-failures 1 so that one blamed failure opens a circuit:
a client's cancellation or deadline, a full server (in-band OVERLOADED, RESOURCE_EXHAUSTED), bad
input, a call cancelled on the server's side (the issue's measured "CANCELLED") must leave every
circuit closed; a server down, crashed or failing internally (and a prefill whose KV write failed)
must open that server's circuit, and only that one's. The client's status is checked too: 4xx for
its own doing, 429 for a full server, 504 for a deadline.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.common.types import SamplingParams
from pdserve.proto import pdserve_pb2 as pb
from pdserve.proto import pdserve_pb2_grpc as pb_grpc
from pdserve.router.app import Router
from pdserve.router.config import RouterConfig
from pdserve.router.pairing import UpstreamError

HANG = "hang"  # the server never answers: the client's deadline or cancellation ends the call
DEADLINE_S = 1.0
LAYOUT = pb.KVLayout(page_size=16, num_layers=2, kv_heads=4, head_dim=64, dtype="bfloat16", num_pages=1024)


class Healthy(health_pb2_grpc.HealthServicer):
    async def Check(self, request, context):
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


async def act(behaviour, context) -> pb.Error | None:
    """Carry out a scripted failure: abort the call, hang, or return the in-band error to send."""
    if isinstance(behaviour, grpc.StatusCode):
        await context.abort(behaviour, "scripted")
    if behaviour == HANG:
        await asyncio.sleep(10 * DEADLINE_S)  # (cancelled long before)
    return None if behaviour is None else pb.Error(code=behaviour, message=f"scripted {pb.Error.Code.Name(behaviour)}")


class FakeDecode(pb_grpc.DecodeServiceServicer):
    """A decode server that reserves pages and streams two more tokens, unless scripted to fail."""

    def __init__(self):
        self.behaviour = None
        self.got_request = asyncio.Event()

    async def Generate(self, request, context):
        self.got_request.set()
        error = await act(self.behaviour, context)
        if error is not None:
            yield pb.GenerateResponse(error=error)
            return
        yield pb.GenerateResponse(
            destination=pb.KVDestination(
                bootstrap_room=request.bootstrap_room,
                decode_agent_name="decode-0",
                decode_agent_metadata=b"meta",
                page_ids=[3],
                layout=LAYOUT,
                expires_unix_s=time.time() + 30,
            )
        )
        yield pb.GenerateResponse(tokens=pb.TokenChunk(token_ids=[8, 9], index=1))
        yield pb.GenerateResponse(
            finish=pb.FinishInfo(reason=pb.FINISH_REASON_LENGTH, usage=pb.Usage(completion_tokens=3))
        )

    async def GetLoad(self, request, context):
        return pb.Load()


class FakePrefill(pb_grpc.PrefillServiceServicer):
    """A prefill server with the unary Prefill only (the router's early PrefillStreamed attempt is
    then UNIMPLEMENTED, which it retries the plain way without blame)."""

    def __init__(self):
        self.behaviour = None

    async def Prefill(self, request, context):
        error = await act(self.behaviour, context)
        if error is not None:
            return pb.PrefillResponse(error=error)
        return pb.PrefillResponse(first_token_id=7, prompt_tokens=len(request.request.prompt_token_ids))

    async def GetLoad(self, request, context):
        return pb.Load()


async def serve(servicer, add) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    add(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(Healthy(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


CLIENT_CAUSES = [  # (case, which server misbehaves, how, the client's status) -> no circuit opens
    ("client cancels", "decode", HANG, None),
    ("client deadline, decode", "decode", HANG, 504),
    ("client deadline, prefill", "prefill", HANG, 504),
    ("decode full", "decode", pb.Error.OVERLOADED, 429),
    ("prefill full", "prefill", pb.Error.OVERLOADED, 429),
    ("prefill resource exhausted", "prefill", grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
    ("bad input, decode", "decode", pb.Error.INVALID_REQUEST, 400),
    ("bad input, prefill", "prefill", pb.Error.INVALID_REQUEST, 400),
    ("decode aborted (deadline)", "decode", pb.Error.ABORTED, 504),
    ("decode call cancelled server-side", "decode", grpc.StatusCode.CANCELLED, 503),
    ("prefill missed its KV reservation", "prefill", pb.Error.KV_TRANSFER_TIMEOUT, 503),
]
SERVER_FAULTS = [  # (case, server, how, status) -> that server's circuit opens
    ("decode down", "decode", grpc.StatusCode.UNAVAILABLE, 503),
    ("decode internal error", "decode", pb.Error.INTERNAL, 502),
    ("decode crashed (unknown status)", "decode", grpc.StatusCode.UNKNOWN, 503),
    ("prefill down", "prefill", grpc.StatusCode.UNAVAILABLE, 503),
    ("prefill internal error", "prefill", pb.Error.INTERNAL, 503),
    ("prefill KV write failed", "prefill", pb.Error.KV_TRANSFER_FAILED, 503),
    ("prefill internal status", "prefill", grpc.StatusCode.INTERNAL, 503),
]


async def drive(model: str, role: str, behaviour, cancel: bool = False) -> tuple[int | None, dict[str, bool]]:
    """One choice with `role`'s server scripted to `behaviour` (`cancel`: the client cancels it once
    the decode server has it): the client's HTTP status (None when it cancelled), and whether each
    role's server is routable afterwards."""
    decode, prefill = FakeDecode(), FakePrefill()
    {"decode": decode, "prefill": prefill}[role].behaviour = behaviour
    decode_server, decode_url = await serve(decode, pb_grpc.add_DecodeServiceServicer_to_server)
    prefill_server, prefill_url = await serve(prefill, pb_grpc.add_PrefillServiceServicer_to_server)
    config = RouterConfig(
        model,
        (prefill_url,),
        (decode_url,),
        decode_stream="per-request",
        circuit_failures=1,
        circuit_open_time=60.0,
        request_timeout=DEADLINE_S,
        health_check_interval=60.0,
    )
    router = Router(config)
    await router.start()
    try:
        assert all(router.ready().values()), "the fake servers are not routable to begin with"
        choice = asyncio.create_task(router.choice([1, 2, 3], SamplingParams(max_new_tokens=3, seed=5)))
        if cancel:
            await asyncio.wait_for(decode.got_request.wait(), 5)
            choice.cancel()
        try:
            await asyncio.wait_for(choice, 5 * DEADLINE_S)
            status = 200
        except UpstreamError as e:
            status = e.status
        except asyncio.CancelledError:
            status = None
        return status, {r: all(v.healthy for v in router.registry.views(r)) for r in ("prefill", "decode")}
    finally:
        await router.stop()
        await decode_server.stop(None)
        await prefill_server.stop(None)


@pytest.mark.parametrize("case,role,behaviour,status", CLIENT_CAUSES, ids=[c[0] for c in CLIENT_CAUSES])
def test_no_circuit_opens_for_what_is_not_the_servers_fault(tiny_models, case, role, behaviour, status):
    got, routable = asyncio.run(drive(tiny_models("llama"), role, behaviour, cancel=status is None))
    assert got == status, case
    assert routable == {"prefill": True, "decode": True}, case


@pytest.mark.parametrize("case,role,behaviour,status", SERVER_FAULTS, ids=[c[0] for c in SERVER_FAULTS])
def test_a_server_fault_opens_that_servers_circuit_only(tiny_models, case, role, behaviour, status):
    got, routable = asyncio.run(drive(tiny_models("llama"), role, behaviour))
    assert got == status, case
    assert routable == {"prefill": role != "prefill", "decode": role != "decode"}, case


def test_the_fakes_serve_a_choice(tiny_models):
    """The control: unscripted, the fake servers serve the choice."""
    assert asyncio.run(drive(tiny_models("llama"), "decode", None)) == (200, {"prefill": True, "decode": True})
