"""Requests that would hold a router worker's event loop, against a real router and decode server:
a body past the byte limit (413 before it is read, by its Content-Length or as it arrives chunked),
a text prompt that cannot fit the context (400 before it is tokenized), a client that stops reading
its stream (dropped, its request aborted), the loop-lag gauge; and a health probe that timed out
while the router's own loop was late, which blames no server."""

import asyncio
import json
import socket
import time
import urllib.request
from concurrent import futures

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.common.tokenizer import load_tokenizer
from tests.router_stack import RouterProcess
from tests.test_servers import Server, wait_idle

MAX_BODY = 200_000


@pytest.fixture(scope="module")
def stack(tiny_models):
    model = tiny_models("llama")
    decode = Server("decode", model)
    decode.wait_ready()
    router = RouterProcess(model, [], [decode], "--disagg-policy", "never", "--max-body-bytes", str(MAX_BODY),
                           "--stream-send-timeout", "2")  # fmt: skip
    router.wait_ready()
    yield model, router.port, decode, router
    router.stop()
    decode.stop()


def raw_post(port: int, head: str, body_parts: list[bytes]) -> tuple[int, dict]:
    """POST /v1/completions over a plain socket: `head` holds the length or chunking headers; the
    body parts are sent as long as the router reads them. Returns the status and the JSON answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{head}\r\n".encode())
        try:
            for part in body_parts:
                s.sendall(part)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the router answered and closed before the whole body went
        data = b""
        while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < _length(data):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    head_bytes, _, payload = data.partition(b"\r\n\r\n")
    return int(head_bytes.split()[1]), json.loads(payload[: _length(data)])


def _length(data: bytes) -> int:
    for line in data.split(b"\r\n\r\n", 1)[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":")[1])
    return 1 << 30


def bystander_ok(model: str, port: int) -> bool:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", timeout=30, max_retries=0)
    out = client.completions.create(model=model, prompt=[0, 5, 6], max_tokens=2, temperature=0)
    return len(out.choices[0].text) >= 0 and out.usage.completion_tokens == 2


def test_a_body_past_the_limit_gets_413_before_it_is_read(stack):
    model, port, decode, _ = stack
    started = time.monotonic()
    status, reply = raw_post(port, "Content-Length: 50000000\r\n", [b'{"prompt": "' + b"a" * 4096])
    assert status == 413 and "--max-body-bytes" in reply["error"]["message"], reply
    assert time.monotonic() - started < 10  # answered from the header: the 50 MB never came
    assert bystander_ok(model, port)


def test_a_chunked_body_past_the_limit_gets_413_as_it_arrives(stack):
    model, port, _, _ = stack
    piece = b"a" * 50_000
    chunks = [b"%x\r\n%s\r\n" % (len(piece), piece) for _ in range(6)] + [b"0\r\n\r\n"]
    status, reply = raw_post(port, "Transfer-Encoding: chunked\r\n", chunks)
    assert status == 413 and str(MAX_BODY) in reply["error"]["message"], reply
    assert bystander_ok(model, port)


def test_a_text_prompt_that_cannot_fit_the_context_gets_400_before_it_is_tokenized(stack):
    model, port, decode, _ = stack
    tokenizer = load_tokenizer(model)
    longest = max(map(len, tokenizer.get_vocab()))
    context = json.load(open(f"{model}/config.json"))["max_position_embeddings"]
    chars = 2 * context * longest + 1
    assert chars < MAX_BODY - 100  # under the byte limit: this is the text check, not the body's
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", timeout=30, max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt="a" * chars, max_tokens=2)
    assert f"{chars} characters" in str(e.value) and f"{context} tokens" in str(e.value)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "b" * chars}], max_tokens=2)
    assert bystander_ok(model, port)
    asyncio.run(wait_idle(decode))  # (nothing of the refused prompts reached it; the bystander's is freed)


def test_a_stream_whose_client_takes_no_chunk_is_dropped_and_its_body_closed():
    """The client stopped reading (its buffers are full: a send never returns): past the send timeout
    the answer's body generator is closed (the route's `finally` cancels its choices on the servers)
    and the admission slots go back."""
    from pdserve.router.http_answers import AdmittedStream
    from pdserve.router.openai_routes import counted

    closed, released, sent = [], [], []

    async def body():
        try:
            for i in range(10_000):
                yield f"data: {i}\n\n"
        finally:
            closed.append(True)

    async def send(message):
        sent.append(message)
        if len(sent) > 3:
            await asyncio.sleep(3600)  # the transport never drains

    async def receive():
        await asyncio.sleep(3600)  # no disconnect either: the client is there, it just does not read
        return {"type": "http.disconnect"}

    router = type("Router", (), {"inflight": 0})()
    chunks = counted(router, body())  # as the OpenAI route wraps its stream
    response = AdmittedStream(chunks, lambda: released.append(True), send_timeout=0.3, media_type="text/event-stream")
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "method": "POST"}
    started = time.monotonic()

    async def answer() -> list:
        await asyncio.wait_for(response(scope, receive, send), 10)
        return list(closed)  # closed by then, not only when the loop shuts down its generators

    assert asyncio.run(answer()) == [True] and released == [True] and len(sent) == 4 and router.inflight == 0
    assert time.monotonic() - started < 5


def test_metrics_show_the_event_loop_lag(stack):
    _, port, _, _ = stack
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    [line] = [x for x in text.splitlines() if x.startswith("pdserve_router_event_loop_lag_seconds")]
    assert 0 <= float(line.split()[-1]) < 5


class SlowHealth(health_pb2_grpc.HealthServicer):
    def Check(self, request, context):  # noqa: N802 - gRPC's name
        time.sleep(0.6)
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


@pytest.mark.parametrize("loop_late", [False, True])
def test_a_probe_that_timed_out_while_the_routers_loop_was_late_blames_no_server(loop_late):
    from pdserve.router.config import RouterConfig
    from pdserve.router.loop_lag import LoopLag
    from pdserve.router.workers import Worker, WorkerRegistry

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(SlowHealth(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    url = f"127.0.0.1:{port}"
    lag = LoopLag(period_s=0.02)
    registry = WorkerRegistry(RouterConfig(prefill=(url,), health_check_timeout=0.3), loop_lag=lag)

    async def probe() -> Worker:
        lag.start()
        w = registry.workers[url] = Worker(url, "prefill", grpc.aio.insecure_channel(url), serving=True, seen=True)
        await asyncio.sleep(0.1)
        check = asyncio.create_task(registry.check_all())
        await asyncio.sleep(0.01)  # the probe is out
        if loop_late:
            time.sleep(0.5)  # the router's own loop is held (a huge request, say) past the probe's timeout
        await check
        await lag.stop()
        await w.channel.close()
        return w

    try:
        w = asyncio.run(probe())
    finally:
        server.stop(0)
    if loop_late:  # no evidence about the server: nothing changes
        assert (w.failures, w.errors, w.serving) == (0, 0, True)
    else:  # the server itself was slow: a failed check
        assert (w.failures, w.errors, w.serving) == (1, 1, False)


def test_deep_json_gets_400(stack):
    _, port, _, _ = stack
    depth = 40_000
    body = b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}"
    status, reply = raw_post(port, f"Content-Length: {len(body)}\r\n", [body])
    assert status == 400 and "nested too deeply" in reply["error"]["message"], reply


def test_idle_slow_and_aborted_clients_leave_bystanders_served_and_no_server_blamed(stack):
    model, port, decode, router = stack
    idle = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(300)]
    loris = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(100)]
    for s in loris:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")
    worst, deadline = 0.0, time.monotonic() + 3
    while time.monotonic() < deadline:  # a header byte each 0.2 s, bystanders asking meanwhile
        for s in loris:
            s.sendall(b"x")
        asked = time.monotonic()
        assert bystander_ok(model, port)
        worst = max(worst, time.monotonic() - asked)
        time.sleep(0.2)
    body = json.dumps({"model": model, "prompt": [0, 5, 6], "max_tokens": 200, "stream": True}).encode()
    for _ in range(30):  # streams dropped after their first bytes
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
            assert s.recv(64).startswith(b"HTTP/1.1 200")
    for s in idle + loris:
        s.close()
    asked = time.monotonic()
    assert bystander_ok(model, port)
    worst = max(worst, time.monotonic() - asked)
    asyncio.run(wait_idle(decode))  # every aborted stream's KV back
    assert set(router.worker_errors().values()) == {0.0} and router.unhealthy() == []
    [lag] = [
        float(x.split()[-1]) for x in router.metrics().splitlines() if x.startswith("pdserve_router_event_loop_lag")
    ]
    print(f"\nbystanders' slowest answer {worst * 1e3:.0f} ms; the router's loop at worst {lag * 1e3:.0f} ms late")
    assert worst < 10
