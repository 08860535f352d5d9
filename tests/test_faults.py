"""Faults on the PD path, with real processes: what the client sees, and within what bound."""

import asyncio
import os
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from tests.router_stack import RouterProcess
from tests.test_servers import KV_TIMEOUT, Server, wait_idle

HEALTH = ("--health-check-interval", "0.5", "--health-check-timeout", "0.5")  # 3 failures: ~3 s


@pytest.fixture(scope="module")
def pool(tiny_models):
    """get(role, n): n running servers of the role, idle, shared by the module's tests (a server takes
    seconds of both cores to start). The tests resume every server they stop (SIGCONT) and wait for
    it to be idle again; one they kill stays dead, and a later test asking for that many gets a new one."""
    model = tiny_models("llama")
    started = {"decode": [], "prefill": []}

    def get(role: str, n: int) -> list[Server]:
        servers = started[role]
        servers[:] = [s for s in servers if s.proc.poll() is None]
        while len(servers) < n:
            servers.append(Server(role, model))
        for server in servers[:n]:
            server.wait_ready()
        asyncio.run(wait_idle(*servers[:n]))
        return servers[:n]

    try:
        yield model, get
    finally:
        for server in (*started["decode"], *started["prefill"]):
            server.stop()


def test_a_hung_decode_server_ends_its_streams_with_an_error_in_seconds(pool):
    """SIGSTOP of the only decode server mid-stream: with no other to move it to, the stream ends with an
    error event naming the server within a few health-check intervals (it stayed open until the
    request's deadline, 600 s, before); a Responses stream with `error` and `response.failed`; once the
    server runs again it frees the requests' KV."""
    model, get = pool
    [decode], [prefill] = get("decode", 1), get("prefill", 1)
    router, stopped = None, False
    try:
        router = RouterProcess(model, [prefill], [decode], *HEALTH)
        router.wait_ready()
        client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", timeout=120, max_retries=0)
        stream = client.completions.create(
            model=model, prompt="the hung server", max_tokens=900, temperature=0, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        chunks = iter(stream)
        # and a Responses stream (greedy: this prompt's answer runs past 600 tokens on this model)
        events = iter(client.responses.create(model=model, input="Tell me a long story", max_output_tokens=600,
                                              temperature=0, stream=True))  # fmt: skip
        for _ in range(3):
            next(chunks)
        seen = [next(events).type for _ in range(6)]  # created, in_progress, the message, its part, deltas
        assert seen[-1] == "response.output_text.delta", seen
        os.kill(decode.proc.pid, signal.SIGSTOP)
        stopped, at = True, time.monotonic()
        with pytest.raises(openai.APIError) as failure:
            for chunk in chunks:
                assert chunk.choices[0].finish_reason is None, "the stream ended as if it had finished"
        waited = time.monotonic() - at
        assert "stopped answering" in str(failure.value) and decode.address in str(failure.value)
        assert waited < 20, f"the client waited {waited:.1f}s"
        rest = list(events)  # the Responses stream ends with the error and response.failed, not completed
        assert [e.type for e in rest][-2:] == ["error", "response.failed"], [e.type for e in rest][-4:]
        assert "stopped answering" in rest[-2].message and rest[-1].response.status == "failed"
        assert time.monotonic() - at < 20
        os.kill(decode.proc.pid, signal.SIGCONT)
        stopped = False
        asyncio.run(wait_idle(decode))
    finally:
        if stopped:
            os.kill(decode.proc.pid, signal.SIGCONT)
        if router is not None:
            router.stop()


# Greedy; and sampled with the client's seed and output-only penalties, which the new servers continue
# from the output already sent (SamplingParams.resumed_output_tokens: tests/test_resumed_output.py).
SAMPLED = dict(temperature=0.9, seed=11, frequency_penalty=0.8, presence_penalty=0.4)


@pytest.mark.parametrize(
    ("fault", "sampling"),
    [("SIGSTOP", {"temperature": 0}), ("SIGKILL", SAMPLED)],
    ids=["hung-greedy", "killed-sampled"],
)
def test_a_decode_server_that_hangs_or_dies_has_its_streams_moved(pool, fault, sampling):
    """Two streams, one on each decode server; the server of one is stopped (a hang) or killed
    mid-stream: its stream goes on on the other decode server (the prompt and the tokens already sent
    prefilled again) and ends with exactly the text of an uninterrupted run, within a few health-check
    intervals of the fault (before, a hung server's streams ended with an error after those intervals,
    and a killed one's at once), with its usage (the client's prompt, every output token). The counter
    says one choice moved."""
    model, get = pool
    decodes, [prefill] = get("decode", 2), get("prefill", 1)
    router, stopped = None, None
    try:
        router = RouterProcess(model, [prefill], decodes, *HEALTH, "--decode-policy", "round_robin")
        router.wait_ready()
        client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", timeout=120, max_retries=0)
        ask = dict(model=model, prompt="the moving stream", max_tokens=300, extra_body={"ignore_eos": True}, **sampling)
        whole = client.completions.create(**ask)  # (round robin: decode 0; the streams: 1, 0)
        expected = (whole.choices[0].text, "length", whole.usage.prompt_tokens, 300)
        started = [threading.Event(), threading.Event()]

        def stream(i: int):
            text, finish, usage = "", None, None
            try:
                chunks = client.completions.create(**ask, stream=True, stream_options={"include_usage": True})
                for n, chunk in enumerate(chunks):
                    if chunk.usage is not None:
                        usage = chunk.usage
                    if chunk.choices:
                        text += chunk.choices[0].text
                        finish = chunk.choices[0].finish_reason or finish
                    if n == 3:
                        started[i].set()
            except openai.APIError as e:
                return text, f"error: {e}"
            finally:
                started[i].set()
            return text, finish, usage.prompt_tokens, usage.completion_tokens

        with ThreadPoolExecutor(2) as pool:
            on_1 = pool.submit(stream, 0)
            on_0 = pool.submit(stream, 1)
            assert all(e.wait(60) for e in started)
            victim = decodes[1]
            os.kill(victim.proc.pid, getattr(signal, fault))
            stopped, at = (victim if fault == "SIGSTOP" else None), time.monotonic()
            moved, stayed = on_1.result(), on_0.result()
        assert moved == expected and stayed == expected
        assert time.monotonic() - at < 30
        moves = re.findall(r"^pdserve_router_migrations_total\{reason=\"(\w+)\"\} (\S+)$", router.metrics(), re.M)
        assert moves == [("hung" if fault == "SIGSTOP" else "unavailable", "1.0")], moves
        if stopped is not None:
            os.kill(stopped.proc.pid, signal.SIGCONT)
            stopped = None
            asyncio.run(wait_idle(*decodes, prefill))
        else:
            asyncio.run(wait_idle(decodes[0], prefill))
    finally:
        if stopped is not None:
            os.kill(stopped.proc.pid, signal.SIGCONT)
        if router is not None:
            router.stop()


def test_a_hung_prefill_server_is_abandoned_in_seconds(pool):
    """SIGSTOP of a prefill server: the requests it holds are retried on the other prefill server, and
    once none is left a request fails with a 503 naming the server, within a few health-check
    intervals (before, each waited for the decode server's KV reservation to expire, and got a 502)."""
    model, get = pool
    [decode], prefills = get("decode", 1), get("prefill", 2)
    router, stopped = None, []
    try:
        router = RouterProcess(model, prefills, [decode], *HEALTH)
        router.wait_ready()
        client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", timeout=120, max_retries=0)
        prompts = [f"the hung prefill server {i}" for i in range(4)]

        def complete(prompt: str) -> str:
            return client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0).choices[0].text

        expected = [complete(p) for p in prompts]
        # The requests follow each SIGSTOP at once, before a health check fails: round robin gives
        # the hung server some.
        os.kill(prefills[0].proc.pid, signal.SIGSTOP)
        stopped, at = [prefills[0]], time.monotonic()
        with ThreadPoolExecutor(len(prompts)) as pool:
            assert list(pool.map(complete, prompts)) == expected
        waited = time.monotonic() - at
        assert waited < 8, f"the clients waited {waited:.1f}s (the KV reservations expire at {KV_TIMEOUT:g}s)"
        retried = re.search(r"^pdserve_router_prefill_retries_total (\S+)", router.metrics(), re.M)
        assert retried and float(retried[1]) > 0, "no request was sent to the hung server"

        os.kill(prefills[1].proc.pid, signal.SIGSTOP)
        stopped, at = prefills, time.monotonic()
        with pytest.raises(openai.APIStatusError) as failure:
            complete(prompts[0])
        waited = time.monotonic() - at
        assert failure.value.status_code == 503
        assert "stopped answering" in str(failure.value) and prefills[1].address in str(failure.value)
        assert waited < 8, f"the client waited {waited:.1f}s"

        for server in stopped:
            os.kill(server.proc.pid, signal.SIGCONT)
        stopped = []
        asyncio.run(wait_idle(decode, *prefills))
    finally:
        for server in stopped:
            os.kill(server.proc.pid, signal.SIGCONT)
        if router is not None:
            router.stop()
