"""What the cluster secret costs per RPC: the server's check, and a call with and without it.

    python -m pdserve.bench.micro.rpc_auth [--calls 5000] [--messages 5000] [--repeats 3]

Three numbers (common/trust.py):
  check       the interceptor's own work per RPC (metadata scan + constant-time compare +
              continuation), called in a loop without a network: its floor
  unary       a unary RPC round trip on loopback (grpc.aio client and server in this process,
              bytes in and out): no secret, the secret (SecretChannel + ClusterSecretCheck), and
              the secret attached by a grpc.aio client interceptor instead, for comparison
  stream msg  one message there and back on an open bidirectional stream, likewise (the check
              runs once per call, so only the client side can cost anything per message)
Medians over --repeats runs, in microseconds.
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import statistics
import time
from collections import namedtuple

import grpc

from pdserve.common.trust import SECRET_METADATA_KEY, ClusterSecretCheck, SecretChannel

SERVICE = "pdserve.bench.Echo"
_Details = namedtuple("_Details", "method invocation_metadata")  # what grpc hands an interceptor


async def _echo(request, context):
    return request


async def _chat(requests, context):
    async for request in requests:
        yield request


class _Attach(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, metadata):
        self.metadata = metadata

    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(details._replace(metadata=grpc.aio.Metadata(*self.metadata)), request)


class _AttachStream(grpc.aio.StreamStreamClientInterceptor):
    # NOTE: grpc.aio files an interceptor under the first kind it implements: one class per kind.
    def __init__(self, metadata):
        self.metadata = metadata

    async def intercept_stream_stream(self, continuation, details, requests):
        return await continuation(details._replace(metadata=grpc.aio.Metadata(*self.metadata)), requests)


async def check_cost(calls: int, secret: str) -> float:
    """Microseconds per intercept_service call of an accepted RPC."""
    check = ClusterSecretCheck((secret,))
    details = _Details(
        "/pdserve.v1.DecodeService/GetLoad", (("user-agent", "grpc-python-asyncio/1.85"), (SECRET_METADATA_KEY, secret))
    )
    handler = object()

    async def continuation(_):
        return handler

    start = time.perf_counter()
    for _ in range(calls):
        assert await check.intercept_service(continuation, details) is handler
    return (time.perf_counter() - start) / calls * 1e6


async def round_trips(mode: str, calls: int, messages: int, secret: str) -> tuple[float, float]:
    """(unary, stream message) microseconds per round trip; mode: none, secret, interceptor."""
    metadata = ((SECRET_METADATA_KEY, secret),)
    server = grpc.aio.server(interceptors=[] if mode == "none" else [ClusterSecretCheck((secret,))])
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                SERVICE,
                {
                    "Echo": grpc.unary_unary_rpc_method_handler(_echo),
                    "Chat": grpc.stream_stream_rpc_method_handler(_chat),
                },
            ),
        )
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    interceptors = [_Attach(metadata), _AttachStream(metadata)] if mode == "interceptor" else None
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", interceptors=interceptors)
    if mode == "secret":
        channel = SecretChannel(channel, secret)
    try:
        echo, chat = channel.unary_unary(f"/{SERVICE}/Echo"), channel.stream_stream(f"/{SERVICE}/Chat")
        for _ in range(200):  # warm up
            await echo(b"x", timeout=10)
        start = time.perf_counter()
        for _ in range(calls):
            await echo(b"x", timeout=10)
        unary = (time.perf_counter() - start) / calls * 1e6
        call = chat(timeout=600)
        await call.write(b"y")
        await call.read()
        start = time.perf_counter()
        for _ in range(messages):
            await call.write(b"y")
            await call.read()
        stream = (time.perf_counter() - start) / messages * 1e6
        await call.done_writing()
    finally:
        await channel.close()
        await server.stop(None)
    return unary, stream


async def run(args) -> None:
    secret = secrets.token_hex(32)
    checks = [await check_cost(args.calls * 10, secret) for _ in range(args.repeats)]
    print(f"check       {statistics.median(checks):7.2f} us per RPC (the interceptor alone)")
    rows: dict[str, list[tuple[float, float]]] = {m: [] for m in ("none", "secret", "interceptor")}
    for _ in range(args.repeats):  # interleaved: drift on a shared host hits every mode alike
        for mode in rows:
            rows[mode].append(await round_trips(mode, args.calls, args.messages, secret))
    print(f"{'':12}{'unary us':>10}{'stream msg us':>15}")
    for mode, label in (("none", "no secret"), ("secret", "secret"), ("interceptor", "client icpt")):
        unary = statistics.median(u for u, _ in rows[mode])
        stream = statistics.median(s for _, s in rows[mode])
        print(f"{label:12}{unary:10.1f}{stream:15.1f}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m pdserve.bench.micro.rpc_auth", description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=3000, help="Unary round trips per run (x10 for the check alone).")
    ap.add_argument("--messages", type=int, default=5000, help="Stream messages per run.")
    ap.add_argument("--repeats", type=int, default=3, help="Runs per mode; medians are reported.")
    asyncio.run(run(ap.parse_args(argv)))


if __name__ == "__main__":
    main()
