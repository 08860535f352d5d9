"""Faults on the PD path, with real processes: what the client sees, and within what bound."""

import asyncio
import os
import signal
import time

import openai
import pytest

from tests.router_stack import RouterProcess
from tests.test_servers import Server, wait_idle

HEALTH = ("--health-check-interval", "0.5", "--health-check-timeout", "0.5")  # 3 failures: ~3 s


def test_a_hung_decode_server_ends_its_streams_with_an_error_in_seconds(tiny_models):
    """SIGSTOP of the decode server mid-stream: the stream ends with an error event naming the server
    within a few health-check intervals (it stayed open until the request's deadline, 600 s, before);
    once the server runs again it frees the request's KV."""
    model = tiny_models("llama")
    decode, prefill = Server("decode", model), Server("prefill", model)
    router, stopped = None, False
    try:
        decode.wait_ready()
        prefill.wait_ready()
        router = RouterProcess(model, [prefill], [decode], *HEALTH)
        router.wait_ready()
        client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", timeout=120, max_retries=0)
        stream = client.completions.create(
            model=model, prompt="the hung server", max_tokens=900, temperature=0, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        chunks = iter(stream)
        for _ in range(3):
            next(chunks)
        os.kill(decode.proc.pid, signal.SIGSTOP)
        stopped, at = True, time.monotonic()
        with pytest.raises(openai.APIError) as failure:
            for chunk in chunks:
                assert chunk.choices[0].finish_reason is None, "the stream ended as if it had finished"
        waited = time.monotonic() - at
        assert "stopped answering" in str(failure.value) and decode.address in str(failure.value)
        assert waited < 20, f"the client waited {waited:.1f}s"
        os.kill(decode.proc.pid, signal.SIGCONT)
        stopped = False
        asyncio.run(wait_idle(decode))
    finally:
        if stopped:
            os.kill(decode.proc.pid, signal.SIGCONT)
        if router is not None:
            router.stop()
        decode.stop()
        prefill.stop()
