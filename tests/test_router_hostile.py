"""Requests that would hold a router worker's event loop, against a real router, decode and prefill
server: a body past the byte limit (413 before it is read, by its Content-Length or as it arrives
chunked), a body that does not come whole in time (408), a text prompt that cannot fit the context
(400 before it is tokenized), a client that stops reading its stream (dropped, its request aborted),
requests and answers that are heavy work (parsed and written off the loop), the loop-lag gauge; and
a health probe that timed out while the router's own loop was late, which blames no server.

Then the connection guards (router/http_protocol.py), on both of uvicorn's protocols in-process and
on a second router with 2 worker processes over the same decode server: heads that do not come whole
in time (408), connections past the cap (503 with Retry-After), and streams aborted mid-answer —
bystanders served throughout, no server blamed, the KV idle after, the loops never held."""

import asyncio
import json
import select
import socket
import struct
import time
import urllib.request
from concurrent import futures

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.common.openai.format import format_response
from pdserve.common.tokenizer import load_tokenizer
from tests.router_stack import RouterProcess, send
from tests.test_servers import Server, wait_idle

MAX_BODY = 200_000
BODY_TIMEOUT = 2.0  # the module's router's --body-timeout


@pytest.fixture(scope="module")
def stack(tiny_models):
    """A router whose decode server prefills every request itself, except one that asks for its prompt's
    logprobs: only a prefill server gives those (router/disagg.py)."""
    model = tiny_models("llama")
    decode, prefill = Server("decode", model), Server("prefill", model)
    decode.wait_ready()
    prefill.wait_ready()
    router = RouterProcess(model, [prefill], [decode], "--disagg-policy", "never", "--max-body-bytes", str(MAX_BODY),
                           "--stream-send-timeout", "2", "--body-timeout", str(BODY_TIMEOUT))  # fmt: skip
    router.wait_ready()
    yield model, router.port, decode, router
    router.stop()
    prefill.stop()
    decode.stop()


def raw_post(port: int, head: str, body_parts: list[bytes], path: str = "/v1/completions") -> tuple[int, dict]:
    """POST `path` over a plain socket: `head` holds the length or chunking headers; the body parts
    are sent as long as the router reads them. Returns the status and the JSON answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{head}\r\n".encode())
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
    """A small request on a connection of its own (closed after: it holds no place under a cap)."""
    with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", timeout=30, max_retries=0) as client:
        out = client.completions.create(model=model, prompt=[0, 5, 6], max_tokens=2, temperature=0)
    return len(out.choices[0].text) >= 0 and out.usage.completion_tokens == 2


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/responses", "/tokenize", "/detokenize"])
def test_a_body_past_the_limit_gets_413_before_it_is_read(stack, path):
    model, port, decode, _ = stack
    started = time.monotonic()
    status, reply = raw_post(port, "Content-Length: 50000000\r\n", [b'{"prompt": "' + b"a" * 4096], path)
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


def test_a_body_that_does_not_come_whole_in_time_gets_408_while_bystanders_are_served(stack):
    """A request whose body trickles in (a byte each 0.25 s) gets 408 once it has not come whole within
    --body-timeout of its head, and its connection is closed; bystanders are served meanwhile, and the
    request, which was reading its body, ends quietly."""
    model, port, _, router = stack
    before = closed_connections(router)["body_timeout"]
    payload = json.dumps({"model": model, "prompt": [0, 5, 6], "max_tokens": 2}).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as slow:
        slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(payload))  # fmt: skip
        started, sent = time.monotonic(), 0
        while not select.select([slow], [], [], 0)[0]:
            assert sent < len(payload) - 1 and bystander_ok(model, port)
            slow.sendall(payload[sent : sent + 1])
            sent += 1
            time.sleep(0.25)
        answer, after = read_to_close(slow), time.monotonic() - started
    assert answer.startswith(b"HTTP/1.1 408 ") and b'"code": "body_timeout"' in answer, answer
    assert b"--body-timeout" in answer and BODY_TIMEOUT <= after < BODY_TIMEOUT + 1.5
    assert closed_connections(router)["body_timeout"] == before + 1
    assert bystander_ok(model, port)
    assert set(router.worker_errors().values()) == {0.0} and router.unhealthy() == []
    assert "Traceback" not in router.output()


def test_deep_json_gets_400(stack):
    _, port, _, _ = stack
    depth = 40_000
    body = b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}"
    status, reply = raw_post(port, f"Content-Length: {len(body)}\r\n", [body])
    assert status == 400 and "nested too deeply" in reply["error"]["message"], reply


def test_a_large_body_is_parsed_in_the_parser_process_and_a_dense_one_refused(stack):
    """Bodies of 128 KiB and more are parsed in the router worker's parser process (router/body_parser.py):
    token-id prompts come back whole; a body of more JSON values than any request needs gets 413."""
    model, port, _, _ = stack
    prompts = [[(i * 7 + j) % 500 + 1 for i in range(1000)] for j in range(30)]
    raw = json.dumps({"model": model, "prompt": prompts, "max_tokens": 1, "return_token_ids": True}).encode()
    assert 128 * 1024 <= len(raw) < MAX_BODY
    status, reply = raw_post(port, f"Content-Length: {len(raw)}\r\n", [raw])
    assert status == 200 and [c["prompt_token_ids"] for c in reply["choices"]] == prompts
    dense = json.dumps({"model": model, "prompt": [0, 5, 6], "stop_token_ids": [0] * 70_000}, separators=(",", ":"))
    assert 128 * 1024 <= len(dense) < MAX_BODY
    status, reply = raw_post(port, f"Content-Length: {len(dense)}\r\n", [dense.encode()])
    assert status == 413 and "JSON values" in reply["error"]["message"], reply


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


# ---- heavy work: requests and answers that take the router long to parse or to write --------------


def lag_now(router: RouterProcess) -> float:
    """The worst lag of the router's loop in the last 10 s (the gauge; one process)."""
    [line] = [x for x in router.metrics().splitlines() if x.startswith("pdserve_router_event_loop_lag_seconds")]
    return float(line.split()[-1])


def while_bystanders_ask(model: str, port: int, work) -> tuple[object, float]:
    """`work()`'s result, and the slowest of the bystanders that asked (one after another) while it ran."""
    done, worst = False, [0.0]

    def ask() -> None:
        while not done:
            asked = time.monotonic()
            assert bystander_ok(model, port)
            worst[0] = max(worst[0], time.monotonic() - asked)

    with futures.ThreadPoolExecutor(1) as pool:
        asking = pool.submit(ask)
        time.sleep(0.1)
        try:
            result = work()
        finally:
            done = True
        asking.result()
    return result, worst[0]


def test_requests_and_answers_that_are_heavy_work_leave_the_loop_free(stack):
    """Requests whose parsing or answer is much work for the router: a batch of text prompts each near the
    context's text limit (tokenized), a JSON schema of 150 KB, an echo of a context-long prompt with its
    logprobs and prompt logprobs for 8 choices (whole and streamed), 8 long answers with logprobs. Each
    is answered while a bystander asks again and again; the bystander is answered in time and the
    router's loop is never 50 ms late: the parsing and the answers' writing run on the router's thread
    for heavy work, a large answer's JSON encoded in pieces (router/large_answers.py)."""
    model, port, decode, router = stack
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex jolly kings "
    text = (words * 400)[: 2 * 1024 * max(map(len, load_tokenizer(model).get_vocab()))]  # the text check's limit
    prompt = [(i * 7) % 500 + 1 for i in range(1000)]  # 1000 of the context's 1024 tokens
    schema = {"type": "object", "description": "x" * 150_000, "properties": {"a": {"type": "string"}}}
    echo = {"prompt": prompt, "max_tokens": 1, "n": 8, "echo": True, "logprobs": 5}
    cases = {
        "7 text prompts near the limit": {"prompt": [text] * 7, "max_tokens": 1},
        "a 150 KB JSON schema": {
            "prompt": [0, 5, 6],
            "max_tokens": 2,
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
        },
        "an echo of 8 x 1000 tokens with logprobs": echo | {"prompt_logprobs": 20},
        "the same echo streamed": echo | {"stream": True},
        "8 x 300 tokens with logprobs": {"prompt": [0, 5, 6], "max_tokens": 300, "n": 8, "logprobs": 5},
    }
    # The decode server's first structured output starts its grammar worker: every request on that
    # server waits (~1.7 s on the CPU box). The servers' business, not the router's: paid before.
    structured = {"model": model, "prompt": [0, 5, 6], "max_tokens": 2, "response_format": {"type": "json_object"}}
    assert send(router.url, "/v1/completions", structured).status == 200
    answers, slowest = {}, {}
    for name, body in cases.items():
        started = time.monotonic()
        answers[name], slowest[name] = while_bystanders_ask(
            model, port, lambda: send(router.url, "/v1/completions", body | {"model": model, "ignore_eos": True})
        )
        print(f"\n{name}: {answers[name].status} in {time.monotonic() - started:.2f} s; bystanders' slowest "
              f"{slowest[name] * 1e3:.0f} ms, the loop's worst lag so far {lag_now(router) * 1e3:.0f} ms")  # fmt: skip
    assert {name: a.status for name, a in answers.items()} == {name: 400 if "text" in name else 200 for name in cases}
    whole = answers["an echo of 8 x 1000 tokens with logprobs"].json["choices"]
    assert len(whole) == 8 and all(
        len(c["logprobs"]["tokens"]) == 1001 and len(c["prompt_logprobs"]) == 1000 for c in whole
    )
    streamed = [
        e for e in answers["the same echo streamed"].events[:-1] if e["choices"] and e["choices"][0]["logprobs"]
    ]
    assert sorted(len(e["choices"][0]["logprobs"]["tokens"]) for e in streamed) == [1] * 8 + [1000] * 8
    assert all(len(c["logprobs"]["tokens"]) == 300 for c in answers["8 x 300 tokens with logprobs"].json["choices"])
    asyncio.run(wait_idle(decode))
    assert set(router.worker_errors().values()) == {0.0} and router.unhealthy() == []
    assert max(slowest.values()) < 3  # (the servers' work for the heavy request included: 2 cores for all)
    # NOTE: alone the loop's worst lag is 5-30 ms here; with the other test worker busy on the 2 cores it
    # reached 53, 70 and 108 ms (a process short of a core lags whatever it runs). A heavy answer built on
    # the loop would hold it for hundreds of ms: that is what this bound catches.
    assert lag_now(router) < 0.25


def test_a_large_answer_written_in_pieces_is_the_json_a_whole_one_would_be(tiny_models):
    """The answer written off the loop (router/large_answers.py) is byte for byte JSONResponse's, and a
    streamed echo's chunk json.dumps's: whole and chat answers, echo, logprobs, prompt logprobs, ids,
    text past U+FFFF."""
    from fastapi.responses import JSONResponse

    from pdserve.common.openai.api import parse_completion_request
    from pdserve.common.openai.chat import parse_chat_request
    from pdserve.common.types import Completion, FinishReason, TokenLogprob
    from pdserve.router.large_answers import OFF_LOOP_ENTRIES, answer_entries, encoded_answer
    from pdserve.router.stream_chunks import StreamChunks

    tokenizer = load_tokenizer(tiny_models("llama"))
    prompt = [(i * 7) % 500 + 1 for i in range(600)]

    def logprobs(ids):
        return [TokenLogprob(t, -0.5 - t / 100, [((t * 3 + k) % 512, -1.0 - k) for k in range(20)], 1) for t in ids]

    def completion(i: int, params) -> Completion:
        ids = [(i + j) % 512 for j in range(300)]
        return Completion(
            rid=f"r{i}", prompt_ids=prompt, output_ids=ids, text=f"choice {i} \U0001f600 \u00e9" * 50,
            finish_reason=FinishReason.LENGTH, matched_stop=None,
            logprobs=logprobs(ids) if params.logprobs is not None else None,
            prompt_logprobs=[None] + logprobs(prompt[1:]), cached_tokens=0, error=None, error_code=None,
        )  # fmt: skip

    body = {"prompt": prompt, "max_tokens": 300, "n": 3, "echo": True, "logprobs": 5, "prompt_logprobs": 20,
            "return_token_ids": True}  # fmt: skip
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 300, "n": 2, "logprobs": True,
            "top_logprobs": 20, "prompt_logprobs": 3}  # fmt: skip
    for parsed in (
        parse_completion_request(body, tokenizer, "m", 1024, allow_stream=True, vocab_size=512),
        parse_chat_request(chat, tokenizer, "m", 1024, allow_stream=True, vocab_size=512),
    ):
        completions = [completion(i, p) for i, p in enumerate(parsed.params)]
        assert answer_entries(parsed, completions) > OFF_LOOP_ENTRIES
        whole = JSONResponse(format_response(parsed, completions, tokenizer, "id", 7)).body
        assert encoded_answer(parsed, completions, tokenizer, "id", 7) == whole
    streamed = body | {"stream": True, "prompt_logprobs": None}
    parsed = parse_completion_request(streamed, tokenizer, "m", 1024, allow_stream=True, vocab_size=512)
    chunks = StreamChunks(parsed, tokenizer, "id", 7)
    scored = completion(0, parsed.params[0]).prompt_logprobs
    assert chunks._echo(1, prompt, scored, True) == chunks._echo(1, prompt, scored, False)


# ---- connection guards: the header-read timeout and the cap (router/http_protocol.py) --------------


async def ok_app(scope, receive, send):
    """An ASGI app that reads the whole body and answers 200 "ok"."""
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


async def read_answer(reader: asyncio.StreamReader) -> bytes:
    """One answer: its head and as many body bytes as its Content-Length says."""
    head = await reader.readuntil(b"\r\n\r\n")
    return head + await reader.readexactly(_length(head))


@pytest.mark.parametrize("http", ["httptools", "h11"])
def test_both_uvicorn_protocols_time_out_a_slow_head_or_body_and_refuse_connections_past_the_cap(http):
    """uvicorn's two HTTP protocols, each with the guards: a head that does not come whole within the
    timeout gets 408 (from the accept, and on a kept-alive connection from its next request's first
    byte), a body that comes slowly (but within the body timeout) does not; a body that does not come
    whole within the body timeout of its head gets 408, and the app hears its client gone; a connection
    past the cap gets 503 with Retry-After, even one that has sent its request, and a new one is served
    once one of the held ones closed."""
    import uvicorn

    from pdserve.router.http_protocol import Guards, guarded_protocol

    timeout, body_timeout = 0.3, 0.9
    closed: list[str] = []
    guards = Guards(header_timeout_s=timeout, body_timeout_s=body_timeout, max_connections=2, count=closed.append)
    app_heard: list[str] = []  # the disconnects ok_app heard

    async def app(scope, receive, send):
        async def heard():
            message = await receive()
            if message["type"] == "http.disconnect":
                app_heard.append(message["type"])
            return message

        await ok_app(scope, heard, send)

    config = uvicorn.Config(app, http=guarded_protocol(http, guards), lifespan="off", log_level="warning")
    post = b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n"

    async def run() -> None:
        server = uvicorn.Server(config)
        sock = socket.create_server(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:
            await asyncio.sleep(0.01)
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            started = time.monotonic()
            writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n")  # and no more of the head
            assert (await reader.read()).startswith(b"HTTP/1.1 408 ")  # then the connection closed
            # (0.9: the server's clock starts at accept, before open_connection returns to stamp ours)
            assert time.monotonic() - started >= 0.9 * timeout
            writer.close()

            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(post + b"o")
            await asyncio.sleep(2 * timeout)  # the body is slow: not the head timer's business
            writer.write(b"k")
            assert (await read_answer(reader)).endswith(b"\r\n\r\nok")
            await asyncio.sleep(2 * timeout)  # kept alive, idle: uvicorn's keep-alive timeout's business
            writer.write(b"GET / HTTP/1.1\r\n")  # the next request's head, never whole
            started = time.monotonic()
            answer = await reader.read()
            assert answer.startswith(b"HTTP/1.1 408 ") and time.monotonic() - started >= 0.9 * timeout
            assert b'"code": "header_timeout"' in answer
            writer.close()

            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(post + b"o")  # and never the body's last byte
            started = time.monotonic()
            answer = await reader.read()
            assert answer.startswith(b"HTTP/1.1 408 ") and b'"code": "body_timeout"' in answer, answer
            assert body_timeout <= time.monotonic() - started < body_timeout + 1
            writer.close()
            assert app_heard == ["http.disconnect"]

            held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
            for _, w in held:
                w.write(post)  # heads whole, bodies to come: the connections stay
            await asyncio.sleep(0.1)
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(post + b"ok")  # sent before the answer is read: still answered, not reset
            await asyncio.sleep(0.1)
            answer = await reader.read()
            assert answer.startswith(b"HTTP/1.1 503 ") and b"\r\nretry-after: 1\r\n" in answer, answer
            assert b'"code": "too_many_connections"' in answer
            writer.close()
            held[0][1].close()
            await asyncio.sleep(0.1)
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(post + b"ok")
            assert (await read_answer(reader)).endswith(b"ok")
            writer.close()
            held[1][1].write(b"ok")
            assert (await read_answer(held[1][0])).endswith(b"ok")
            held[1][1].close()
        finally:
            server.should_exit = True
            await serving

    asyncio.run(asyncio.wait_for(run(), 30))
    assert closed == ["header_timeout", "header_timeout", "body_timeout", "over_cap"]


HEAD_TIMEOUT = 2.0  # the guarded router's --header-timeout
CAP = 32  # its --max-connections-per-worker: more than the other tests open at once


@pytest.fixture(scope="module")
def guarded(stack):
    """A second router on the module's decode server, with 2 worker processes (the kernel spreads the
    connections over them: bystanders and hostile clients land on both), a short header timeout and a
    small connection cap. Yields once both workers serve."""
    model, _, decode, _ = stack
    router = RouterProcess(model, [], [decode], "--disagg-policy", "never", "--workers", "2", "--no-warm-spare",
                           "--header-timeout", str(HEAD_TIMEOUT), "--max-connections-per-worker", str(CAP))  # fmt: skip
    router.wait_ready()
    deadline = time.monotonic() + 60
    while len(serving_pids(router)) < 2:
        assert time.monotonic() < deadline, "the second worker does not serve:\n" + router.output()
        time.sleep(0.2)
    yield model, router.port, decode, router
    router.stop()


def series(router: RouterProcess, name: str) -> dict[str, float]:
    """The samples of one metric: their labels as written -> value."""
    return {
        line.split(" ")[0].removeprefix(name): float(line.split(" ")[1])
        for line in router.metrics().splitlines()
        if line.startswith(name)
    }


def serving_pids(router: RouterProcess) -> set[str]:
    """The router processes that serve (each writes its health series once it does)."""
    return {labels.split('pid="')[1].split('"')[0] for labels in series(router, "pdserve_router_worker_healthy")}


def closed_connections(router: RouterProcess) -> dict[str, float]:
    """Connections the router's guards closed, by reason, over its processes."""
    found = series(router, "pdserve_router_connections_closed_total")
    return {
        reason: found.get(f'{{reason="{reason}"}}', 0.0) for reason in ("header_timeout", "body_timeout", "over_cap")
    }


def assert_no_server_blamed(router: RouterProcess, workers: int) -> None:
    health = series(router, "pdserve_router_worker_healthy")
    assert len(health) == workers and set(health.values()) == {1.0}, health  # no circuit opened in any process
    assert set(router.worker_errors().values()) == {0.0}
    assert "circuit open" not in router.output()


def assert_loops_not_held(router: RouterProcess) -> None:
    """No router process's loop ran 50 ms late in the last 10 s (the gauge, a series per process)."""
    lag = max(series(router, "pdserve_router_event_loop_lag_seconds").values())
    print(f"\nthe router's loops at worst {lag * 1e3:.0f} ms late")
    assert lag < 0.05


def read_to_close(s: socket.socket) -> bytes:
    """What the router sends before it closes the connection (a reset ends it too)."""
    data = b""
    s.settimeout(10)
    try:
        while chunk := s.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def test_heads_that_do_not_come_whole_in_time_get_408_while_bystanders_and_slow_bodies_are_served(guarded):
    """Slow-loris and idle connections on both workers: each gets 408 and is closed once its head has
    not come whole within --header-timeout of its accept (not before), while bystanders are answered
    throughout, and a request whose body comes slower than that (its head was whole) is served."""
    model, port, _, router = guarded
    before = closed_connections(router)
    payload = json.dumps({"model": model, "prompt": [0, 5, 6], "max_tokens": 2}).encode()
    slow = socket.create_connection(("127.0.0.1", port), timeout=30)
    slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(payload))  # fmt: skip
    pieces = [payload[i : i + 4] for i in range(0, len(payload), 4)]
    opened = time.monotonic()
    loris = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(16)]
    idle = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(6)]
    for s in loris:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")
    answers: dict[socket.socket, tuple[bytes, float]] = {}  # what each got before it was closed, and when
    deadline = time.monotonic() + 6 * HEAD_TIMEOUT
    while (len(answers) < len(loris + idle) or pieces) and time.monotonic() < deadline:
        waiting = [s for s in loris + idle if s not in answers]
        for s in select.select(waiting, [], [], 0)[0]:
            answers[s] = (read_to_close(s), time.monotonic() - opened)
        for s in loris:
            if s not in answers:
                s.sendall(b"x")  # a header byte each round
        if pieces:
            slow.sendall(pieces.pop(0))  # a body of 13 pieces over 13 rounds: past the header timeout
        assert bystander_ok(model, port)
        time.sleep(0.25)
    assert time.monotonic() - opened > HEAD_TIMEOUT  # the slow body took longer than a head may
    status, reply = raw_read(slow)
    assert status == 200 and reply["usage"]["completion_tokens"] == 2, reply
    assert len(answers) == len(loris + idle), f"{len(loris + idle) - len(answers)} connections left open"
    for got, after in answers.values():
        assert got.startswith(b"HTTP/1.1 408 ") and b'"code": "header_timeout"' in got, got
        assert after >= HEAD_TIMEOUT
    for s in loris + idle + [slow]:
        s.close()
    after = closed_connections(router)
    assert after["header_timeout"] - before["header_timeout"] == len(loris + idle)
    assert after["over_cap"] == before["over_cap"]
    assert bystander_ok(model, port)
    assert_no_server_blamed(router, workers=2)
    assert_loops_not_held(router)


def raw_read(s: socket.socket) -> tuple[int, dict]:
    """The status and JSON body of the answer on `s`."""
    data = b""
    while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < _length(data):
        chunk = s.recv(65536)
        assert chunk, f"closed before a whole answer: {data!r}"
        data += chunk
    head, _, payload = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(payload[: _length(data)])


def test_connections_past_the_cap_get_503_with_retry_after_and_bystanders_recover_once_they_close(guarded):
    """More connections than both workers' caps together, each holding a request whose body has not
    come: each worker keeps exactly --max-connections-per-worker of them and answers every other with
    503 and Retry-After (an OpenAI error body), though it had sent its request; once they close,
    bystanders are served again."""
    model, port, _, router = guarded
    before = closed_connections(router)
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n{")  # fmt: skip
    extra = 40
    conns = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(2 * CAP + extra)]
    for s in conns:
        s.sendall(head)
    refused: dict[socket.socket, bytes] = {}
    deadline = time.monotonic() + 10
    while len(refused) < extra and time.monotonic() < deadline:
        for s in select.select([s for s in conns if s not in refused], [], [], 0.2)[0]:
            refused[s] = read_to_close(s)
    time.sleep(0.5)  # (any more answers would come by now)
    refused.update((s, read_to_close(s)) for s in select.select([s for s in conns if s not in refused], [], [], 0)[0])
    assert len(refused) == extra  # each worker holds exactly its cap (the kernel gave each more than that)
    for got in refused.values():
        assert got.startswith(b"HTTP/1.1 503 ") and b"\r\nretry-after: 1\r\n" in got.lower(), got
        reply = json.loads(got.partition(b"\r\n\r\n")[2])
        assert reply["error"]["code"] == "too_many_connections" and "--max-connections-per-worker" in str(reply)
    with pytest.raises(openai.APIStatusError) as e:  # a bystander now: 503 too, whichever worker it reaches
        bystander_ok(model, port)
    assert e.value.status_code == 503 and e.value.response.headers["retry-after"] == "1"
    for s in conns:
        s.close()
    deadline = time.monotonic() + 10
    while True:  # the workers see the closes
        try:
            if bystander_ok(model, port):
                break
        except openai.APIStatusError:
            assert time.monotonic() < deadline, "bystanders still refused after the held connections closed"
            time.sleep(0.1)
    assert all(bystander_ok(model, port) for _ in range(8))  # fresh connections: both workers
    assert closed_connections(router)["over_cap"] - before["over_cap"] >= extra + 1
    assert_no_server_blamed(router, workers=2)
    assert "Traceback" not in router.output()  # (a client gone before its body came: 499, not a 500)
    assert_loops_not_held(router)


def test_many_streams_aborted_mid_answer_leave_the_kv_idle_and_no_server_blamed(guarded):
    """Clients that start a streamed completion and go away after its first tokens, with a FIN or a
    reset, in waves of 8 over both workers: bystanders are served meanwhile; afterwards the decode
    server holds no KV and runs nothing, no server is blamed, and no router loop was held."""
    model, port, decode, router = guarded
    body = json.dumps({"model": model, "prompt": [0, 5, 6], "max_tokens": 800, "ignore_eos": True, "stream": True})
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n%s" % (len(body), body.encode()))  # fmt: skip
    aborted = 0
    for wave in range(5):
        streams = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(8)]
        for s in streams:
            s.sendall(request)
        for i, s in enumerate(streams):
            got = b""
            while got.count(b"data: ") < 2:  # a token or two in
                chunk = s.recv(65536)
                assert chunk, got
                got += chunk
            assert got.startswith(b"HTTP/1.1 200 ") and b"[DONE]" not in got
            if i % 2:  # a reset rather than a FIN
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            s.close()
            aborted += 1
        assert bystander_ok(model, port)
    assert aborted == 40
    asyncio.run(wait_idle(decode))  # every aborted stream's KV back
    assert all(bystander_ok(model, port) for _ in range(8))
    assert_no_server_blamed(router, workers=2)
    assert_loops_not_held(router)
