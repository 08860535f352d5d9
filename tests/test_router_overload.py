"""One client must not take the service down (a real router, real servers, tiny model).

The issue's measurement: one /v1/completions with 5000 prompts came back 503 and opened both servers'
circuits, so every other user got 503 for 28 s. Now such a request is refused with a 400 naming the
limit (--max-choices) or, where the limit allows it, served through the router's queue a few
choices at a time — and either way the requests of others sent meanwhile are served, and no circuit
opens. Beyond the router's capacity requests wait in its queue, and past the queue's bound or
deadline get 429 with Retry-After and OpenAI's error body.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
import time

import pytest

from pdserve.common.tiny_model import make_tiny_model
from tests.router_stack import RouterProcess, openai_error_problem, send
from tests.test_servers import Server, wait_idle

BIG = {"prompt": ["hi"] * 5000, "max_tokens": 1}
NORMAL = {"prompt": "hello there", "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    # A long context, so that a held stream (Holder) outlasts every wait here however fast the
    # box decodes: 1,000 tokens once finished within a 2 s queue timeout on a CI machine.
    model = str(
        make_tiny_model(tmp_path_factory.mktemp("long") / "llama", "llama", 0, {"max_position_embeddings": 4096})
    )
    decode, prefill = Server("decode", model), Server("prefill", model)
    try:
        decode.wait_ready()
        prefill.wait_ready()
        yield model, decode, prefill
    finally:
        decode.stop()
        prefill.stop()


def router_of(servers, *flags: str) -> RouterProcess:
    model, decode, prefill = servers
    router = RouterProcess(model, [prefill], [decode], *flags)
    router.wait_ready()
    return router


def in_background(fn, *args) -> tuple[threading.Thread, list]:
    """Run fn(*args) in a thread; the list gets its result (or exception)."""
    out: list = []

    def run():
        try:
            out.append(fn(*args))
        except Exception as e:  # noqa: BLE001 (the test looks at it)
            out.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def normal_requests_while(thread: threading.Thread, url: str, at_least: int) -> list:
    """Send normal requests one after another until `thread` is done (and at least `at_least`)."""
    answers = []
    while thread.is_alive() or len(answers) < at_least:
        started = time.monotonic()
        answer = send(url, "/v1/completions", NORMAL, timeout=60)
        answers.append((answer.status, time.monotonic() - started, answer.raw[:200]))
    return answers


def test_5000_prompts_get_a_400_naming_the_limit_and_others_are_served(servers):
    router = router_of(servers)
    try:
        big, result = in_background(send, router.url, "/v1/completions", BIG)
        normal = normal_requests_while(big, router.url, at_least=3)
        big.join(60)
        [answer] = result
        assert answer.status == 400 and openai_error_problem(answer) is None, answer
        message = answer.json["error"]["message"]
        assert "5000 choices" in message and "256" in message and "--max-choices" in message, message
        assert all(status == 200 for status, _, _ in normal), normal
        assert router.unhealthy() == [] and not any(router.worker_errors().values())
    finally:
        router.stop()


def test_5000_prompts_allowed_are_served_queued_and_others_still_are(servers):
    _, decode, prefill = servers
    router = router_of(servers, "--max-choices", "5000")
    try:
        started = time.monotonic()
        big, result = in_background(send, router.url, "/v1/completions", BIG, 600)
        normal = normal_requests_while(big, router.url, at_least=3)
        big.join(600)
        took = time.monotonic() - started
        [answer] = result
        assert answer.status == 200, answer
        assert len(answer.json["choices"]) == 5000 and answer.json["usage"]["completion_tokens"] == 5000
        assert [status for status, _, _ in normal] == [200] * len(normal), normal
        slowest = max(t for _, t, _ in normal)
        print(f"5000 choices in {took:.1f}s; {len(normal)} normal requests meanwhile, the slowest {slowest:.2f}s")
        assert slowest < 5.0, normal  # they take their turn beside the big one's lanes, not after it
        assert router.unhealthy() == [] and not any(router.worker_errors().values())
    finally:
        router.stop()
    asyncio.run(wait_idle(decode, prefill))


def test_overload_waits_in_the_queue_then_gets_429_with_retry_after(servers):
    """One choice slot, one place in the queue, two seconds of waiting at most."""
    model, decode, prefill = servers
    router = router_of(servers, "--max-inflight", "1", "--max-queued", "1", "--queue-timeout", "2")
    hold = {"prompt": "a", "max_tokens": 4000, "stream": True, "ignore_eos": True}
    try:
        holder = Holder(router.url, hold)  # takes the one slot until closed
        started = time.monotonic()
        waiter, result = in_background(send, router.url, "/v1/completions", NORMAL)  # queued
        time.sleep(0.5)
        full = send(router.url, "/v1/completions", NORMAL)  # the queue is full: 429 at once
        assert full.status == 429 and full.headers["retry-after"] == "1" and openai_error_problem(full) is None, full
        assert "queue is full" in full.json["error"]["message"]
        waiter.join(30)
        [timed_out] = result
        assert timed_out.status == 429 and time.monotonic() - started >= 2.0, timed_out  # it waited its 2 s
        assert "--queue-timeout" in timed_out.json["error"]["message"] and timed_out.headers["retry-after"] == "1"
        # A request that waits while the slot frees gets served: queued, not refused.
        waiter, result = in_background(send, router.url, "/v1/completions", NORMAL)
        time.sleep(0.5)
        holder.close()
        waiter.join(30)
        assert result[0].status == 200, result
        assert router.unhealthy() == [] and not any(router.worker_errors().values())
    finally:
        router.stop()
    asyncio.run(wait_idle(decode, prefill))


class Holder:
    """A streaming request held open (its first event read) until closed."""

    def __init__(self, url: str, body: dict):
        host, port = url.removeprefix("http://").split(":")
        self.conn = http.client.HTTPConnection(host, int(port), timeout=60)
        self.conn.request(
            "POST", "/v1/completions", body=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        self.response = self.conn.getresponse()
        assert self.response.status == 200 and self.response.readline().startswith(b"data: ")

    def close(self) -> None:
        self.conn.close()
