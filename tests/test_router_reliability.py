"""The router's must-shows beyond the happy path: a bad-input table, 200 concurrent streams, a
prefill killed under load (the retry path), and a client that disconnects mid-stream."""

import asyncio
import json
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import openai
import pytest

from pdserve.common.ports import free_port
from tests.test_servers import Server, load, wait_idle


@pytest.fixture(scope="module")
def cluster(tiny_models):
    model = tiny_models("llama")
    decode = Server("decode", model)
    prefills = [Server("prefill", model), Server("prefill", model)]
    for s in (decode, *prefills):
        s.wait_ready()
    port = free_port()
    router = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pdserve.router.cli",
            "--model-path",
            model,
            "--port",
            str(port),
            "--prefill",
            *(p.address for p in prefills),
            "--decode",
            decode.address,
            "--log-level",
            "warning",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(url + "/readiness", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        assert time.monotonic() < deadline and router.poll() is None, "router not ready"
        time.sleep(0.2)
    yield model, url, decode, prefills
    router.terminate()
    router.wait(30)
    for s in (decode, *prefills):
        s.stop()


def post(url, body: bytes | dict):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


BAD = [
    ("/v1/completions", b"{oops", 400, "not valid JSON"),
    ("/v1/completions", {"model": "nope", "prompt": "x"}, 404, "does not exist"),
    ("/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 10**9}, 400, "maximum context length"),
    ("/v1/completions", {"prompt": [0] + [7] * 2000, "max_tokens": 1}, 400, "maximum context length"),
    ("/v1/completions", {"prompt": "x", "temperature": 3}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "role"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, "content"),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n"),
    ("/generate", {"text": "x", "input_ids": [1]}, 400, "exactly one"),
]


@pytest.mark.parametrize("path,body,status,words", BAD, ids=[f"{i}-{b[2]}" for i, b in enumerate(BAD)])
def test_bad_input_gets_a_clear_openai_error(cluster, path, body, status, words):
    _, url, _, _ = cluster
    code, reply = post(url + path, body)
    assert code == status and words in reply["error"]["message"], reply
    assert reply["error"]["type"] == "invalid_request_error"


def test_native_generate(cluster):
    _, url, _, _ = cluster
    code, reply = post(
        url + "/generate", {"input_ids": [0, 5, 6, 7], "sampling_params": {"max_tokens": 4, "temperature": 0}}
    )
    assert code == 200 and len(reply["output_ids"]) == 4 and reply["usage"]["completion_tokens"] == 4


async def completion_text(client, model: str, prompt: str, stream: bool) -> str:
    """A greedy 8-token completion's text (ignore_eos), whole or put together from its stream."""
    kw = dict(model=model, prompt=prompt, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    if not stream:
        return (await client.completions.create(**kw)).choices[0].text
    chunks = await client.completions.create(stream=True, **kw)
    return "".join([c.choices[0].text async for c in chunks if c.choices])


def test_200_concurrent_streams_lose_and_duplicate_nothing(cluster):
    model, url, decode, prefills = cluster
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", timeout=300, max_retries=0)
    prompts = [f"stream {i} " + "word " * (i % 13) for i in range(200)]

    def one(prompt, stream):
        return completion_text(client, model, prompt, stream)

    async def main():
        streamed = await asyncio.gather(*(one(p, True) for p in prompts))
        plain = await asyncio.gather(*(one(p, False) for p in prompts[:20]))
        return streamed, plain

    streamed, plain = asyncio.run(main())
    assert streamed[:20] == plain and all(streamed)
    asyncio.run(wait_idle(decode, *prefills))


def test_a_client_disconnect_mid_stream_frees_kv_on_both_sides(cluster):
    model, url, decode, prefills = cluster
    body = json.dumps(
        {"model": model, "prompt": "abc", "max_tokens": 400, "temperature": 0, "stream": True, "ignore_eos": True}
    ).encode()
    request = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    response = urllib.request.urlopen(request, timeout=60)
    assert response.readline().startswith(b"data: ")  # streaming has started
    response.close()  # the client goes away
    asyncio.run(wait_idle(decode, *prefills))


def test_a_client_gone_before_a_whole_answer_gets_499_and_frees_kv(cluster):
    model, url, decode, prefills = cluster
    body = json.dumps({"model": model, "prompt": "abc", "max_tokens": 1000, "temperature": 0, "ignore_eos": True})
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        conn.sendall(
            f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n{body}".encode()
        )
        deadline = time.monotonic() + 30
        while not asyncio.run(load(decode)).running_requests:  # until the answer is being computed
            assert time.monotonic() < deadline, "the request never reached the decode server"
            time.sleep(0.01)
    deadline = time.monotonic() + 30
    while 'status="499"' not in urllib.request.urlopen(url + "/metrics", timeout=10).read().decode():
        assert time.monotonic() < deadline, "the router never noticed the client leave"
        time.sleep(0.1)
    asyncio.run(wait_idle(decode, *prefills))


def test_a_prefill_killed_under_load_is_retried_elsewhere(cluster):
    model, url, decode, prefills = cluster
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", timeout=300, max_retries=0)

    async def main():
        tasks = [
            asyncio.create_task(
                client.completions.create(model=model, prompt=f"load {i} " + "x " * 40, max_tokens=6, temperature=0)
            )
            for i in range(30)
        ]
        await asyncio.sleep(0.3)
        prefills[1].proc.send_signal(signal.SIGKILL)  # one prefill dies mid-load
        return await asyncio.gather(*tasks, return_exceptions=True)

    results = asyncio.run(main())
    failed = [r for r in results if isinstance(r, Exception)]
    assert not failed, failed[:3]
    assert all(r.choices[0].finish_reason in ("length", "stop") for r in results)
    asyncio.run(wait_idle(decode, prefills[0]))


def test_saturation_gets_429_with_retry_after(cluster):
    model, _, decode, prefills = cluster
    port = free_port()
    router = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pdserve.router.cli",
            "--model-path",
            model,
            "--port",
            str(port),
            "--prefill",
            prefills[0].address,
            "--decode",
            decode.address,
            "--max-inflight",
            "1",
            "--max-queued",
            "0",
            "--log-level",
            "warning",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(url + "/readiness", timeout=2)
                break
            except OSError:
                assert time.monotonic() < deadline
                time.sleep(0.2)
        slow = json.dumps(
            {"model": model, "prompt": "a", "max_tokens": 300, "stream": True, "ignore_eos": True}
        ).encode()
        held = urllib.request.urlopen(
            urllib.request.Request(url + "/v1/completions", data=slow, headers={"Content-Type": "application/json"}),
            timeout=60,
        )
        held.readline()
        request = urllib.request.Request(
            url + "/v1/completions",
            data=json.dumps({"prompt": "b", "max_tokens": 2}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(request, timeout=30)
        assert e.value.code == 429 and e.value.headers["Retry-After"] == "1"
        held.close()
    finally:
        router.terminate()
        router.wait(30)
    asyncio.run(wait_idle(decode, prefills[0]))


def test_circuit_breaker_opens_after_failures_and_closes_on_success():
    from pdserve.router.config import RouterConfig
    from pdserve.router.workers import Worker, WorkerRegistry

    registry = WorkerRegistry(RouterConfig(prefill=("p:1",), decode=("d:1",)))
    FAILURES_TO_OPEN = registry.config.circuit_failures
    registry.workers = {
        "p:1": Worker("p:1", "prefill", None, serving=True),
        "d:1": Worker("d:1", "decode", None, serving=True),
    }
    for _ in range(FAILURES_TO_OPEN - 1):
        registry.record("p:1", ok=False)
    assert [v.healthy for v in registry.views("prefill")] == [True]
    registry.record("p:1", ok=False)
    assert [v.healthy for v in registry.views("prefill")] == [False]  # open
    registry.workers["p:1"].open_until = time.monotonic()  # the open period is over: half-open
    assert [v.healthy for v in registry.views("prefill")] == [True]
    registry.record("p:1", ok=True)
    assert registry.workers["p:1"].failures == 0 and registry.workers["p:1"].errors == FAILURES_TO_OPEN


def test_api_key_is_required_when_set_and_no_worker_means_503(tiny_models):
    from fastapi.testclient import TestClient

    from pdserve.router.app import Router, RouterConfig, create_app

    config = RouterConfig(
        tiny_models("llama"), (f"127.0.0.1:{free_port()}",), (f"127.0.0.1:{free_port()}",), api_key="sekret"
    )
    with TestClient(create_app(Router(config))) as http:
        body = {"prompt": "x", "max_tokens": 2}
        denied = http.post("/v1/completions", json=body)
        assert denied.status_code == 401 and "API key" in denied.json()["error"]["message"]
        down = http.post("/v1/completions", json=body, headers={"Authorization": "Bearer sekret"})
        assert down.status_code == 503 and down.headers["Retry-After"] == "5"  # nothing is listening there
        assert http.get("/readiness").status_code == 503


def test_dns_discovery_adds_and_removes_workers_while_serving(tiny_models):
    """A headless Service's answer changes: {A} -> {A, B} -> {B}. The router follows it, health-gated,
    and requests keep succeeding. Two prefill servers share one port on two loopback addresses."""
    from fastapi.testclient import TestClient

    from pdserve.router.app import Router, RouterConfig, create_app

    model = tiny_models("llama")
    port = free_port()
    decode = Server("decode", model)
    prefill_a = Server("prefill", model, "--host", "127.0.0.2", "--port", str(port))
    prefill_b = Server("prefill", model, "--host", "127.0.0.3", "--port", str(port))
    prefill_a.address, prefill_b.address = f"127.0.0.2:{port}", f"127.0.0.3:{port}"
    answers = {prefill_a.address}

    def fake_dns(name, p):
        return set(answers) if (name, p) == ("pdserve-prefill.test", port) else set()

    try:
        for s in (decode, prefill_a, prefill_b):
            s.wait_ready()
        config = RouterConfig(
            model, (), (decode.address,), prefill_dns=(f"pdserve-prefill.test:{port}",), dns_interval=0.3
        )
        with TestClient(create_app(Router(config, resolve=fake_dns))) as http:

            def ask(n=4):
                for i in range(n):
                    r = http.post("/v1/completions", json={"prompt": f"dns {i}", "max_tokens": 3, "temperature": 0})
                    assert r.status_code == 200, r.text

            def wait_for(expected):
                deadline = time.monotonic() + 20
                while http.get("/readiness").json().get("prefill") != expected:
                    assert time.monotonic() < deadline, http.get("/readiness").json()
                    time.sleep(0.1)

            wait_for([prefill_a.address])
            ask()
            answers.add(prefill_b.address)
            wait_for(sorted([prefill_a.address, prefill_b.address]))
            ask(8)
            answers.discard(prefill_a.address)
            wait_for([prefill_b.address])
            ask()
    finally:
        for s in (decode, prefill_a, prefill_b):
            s.stop()


def test_a_dead_decode_server_opens_its_circuit(tiny_models):
    from fastapi.testclient import TestClient

    from pdserve.router.app import Router, RouterConfig, create_app

    FAILURES_TO_OPEN = RouterConfig().circuit_failures
    model = tiny_models("llama")
    decode, prefill = Server("decode", model), Server("prefill", model)
    try:
        decode.wait_ready()
        prefill.wait_ready()
        router = Router(RouterConfig(model, (prefill.address,), (decode.address,)))
        with TestClient(create_app(router)) as http:
            assert http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200
            decode.proc.kill()
            decode.proc.wait(10)
            codes = [
                http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code
                for _ in range(FAILURES_TO_OPEN + 1)
            ]
            assert all(c == 503 for c in codes), codes
            assert router.registry.workers[decode.address].errors >= FAILURES_TO_OPEN
            assert http.get("/readiness").status_code == 503  # the decode is no longer routable
    finally:
        decode.stop()
        prefill.stop()


def test_a_worker_still_starting_fails_checks_without_opening_its_circuit():
    """`pdserve up` starts the router beside its servers: checks of a server that has never answered
    are not failures (nothing listens yet), but once it has answered, failed checks count again."""
    import grpc

    from pdserve.router.config import RouterConfig
    from pdserve.router.workers import Worker, WorkerRegistry

    url = f"127.0.0.1:{free_port()}"  # nothing listens there: a server still starting
    limit = RouterConfig().circuit_failures
    registry = WorkerRegistry(RouterConfig(prefill=(url,), decode=(url,), health_check_timeout=0.5))

    async def checks() -> tuple:
        w = registry.workers[url] = Worker(url, "prefill", grpc.aio.insecure_channel(url))
        for _ in range(limit + 2):
            await registry.check_all()
        starting = (w.seen, w.serving, w.failures, w.open_until)
        w.seen = True  # it answered once; now it is gone
        for _ in range(limit):
            await registry.check_all()
        await w.channel.close()
        return starting, w.failures, w.open_until

    starting, failures, open_until = asyncio.run(checks())
    assert starting == (False, False, 0, 0.0)
    assert failures == limit and open_until > time.monotonic()


def test_a_starting_server_is_routable_within_a_tenth_of_a_second_of_serving():
    """A server not yet SERVING once is checked every STARTING_CHECK_S (router/workers.py), not only
    every --health-check-interval (5 s here): routable within a fraction of a second of its model being
    loaded. Once it has served, it is checked at the interval again (its failed checks pace circuits)."""
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    from pdserve.proto import pdserve_pb2 as pb
    from pdserve.proto import pdserve_pb2_grpc as pb_grpc
    from pdserve.router.config import RouterConfig
    from pdserve.router.workers import STARTING_CHECK_S, WorkerRegistry

    loads = []

    class Decode(pb_grpc.DecodeServiceServicer):
        async def GetLoad(self, request, context):
            loads.append(time.monotonic())
            return pb.Load()

    async def scenario() -> tuple[float, int]:
        server, port = grpc.aio.server(), free_port()
        health_servicer = health.aio.HealthServicer()
        await health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        pb_grpc.add_DecodeServiceServicer_to_server(Decode(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        registry = WorkerRegistry(RouterConfig(decode=(f"127.0.0.1:{port}",), health_check_interval=5.0))
        await registry.start()  # one round now: NOT_SERVING (the model still loading)
        (worker,) = registry.workers.values()
        assert not worker.serving
        await asyncio.sleep(0.5)
        assert len(loads) >= 3  # checked while starting, well inside the 5 s interval
        await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        served_at = time.monotonic()
        while not worker.serving:
            await asyncio.sleep(0.01)
        routable_after = time.monotonic() - served_at
        checks_before = len(loads)
        await asyncio.sleep(1.0)
        later_checks = len(loads) - checks_before  # served once: back to every 5 s
        await registry.stop()
        await server.stop(None)
        return routable_after, later_checks

    routable_after, later_checks = asyncio.run(scenario())
    assert routable_after < 3 * STARTING_CHECK_S + 0.2
    assert later_checks == 0
