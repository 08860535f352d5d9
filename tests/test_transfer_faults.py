"""KV transfers that fail or lose their notification, injected in the prefill server's transfer layer
(common/kv_transfer/faults.py, PDSERVE_KV_FAULTS) between real processes: each request ends with the
right text or a clear error within its bound — never a wrong answer, never a hang — KV returns to idle
on both servers, and the stack serves the next request."""

import asyncio
import json
import re
import socket
import time

import openai
import pytest

from pdserve.common.kv_transfer.faults import ENV, KVFaults
from tests.router_stack import RouterProcess
from tests.test_servers import Server, wait_idle

KV_TIMEOUT = ("--kv-transfer-timeout", "3")  # a lost notification costs the request this long


def test_the_fault_spec_is_checked():
    faults = KVFaults("fail_write=2, drop_notif=3")
    assert [faults.next_write() for _ in range(6)] == [
        None,
        "fail_write",
        "drop_notif",
        "fail_write",
        None,
        "fail_write",
    ]
    for bad in ("fail_write", "fail_write=0", "lose=2", "drop_notif=x"):
        with pytest.raises(ValueError, match=ENV):
            KVFaults(bad)


# A lost notification fails its request at the decode server's --kv-transfer-timeout (it cannot tell
# a late WRITE from a lost one). A WRITE that fails to start is an error the prefill server returns at
# once, which the router retries (one failing WRITE in two: every request was answered, measured; not
# a case here, to keep the suite short); when every WRITE fails, the request fails after its attempts
# with the transfer's error, and once the failures open the server's circuit, at once, saying no
# server is healthy.
@pytest.fixture(scope="module")
def decode(tiny_models):
    """The decode server of both cases (the fault is the prefill server's; each case ends with it idle)."""
    server = Server("decode", tiny_models("llama"), *KV_TIMEOUT)
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.parametrize(
    "spec, error",
    [
        ("drop_notif=2", "KV transfer timed out"),
        ("fail_write=1", "injected fault|no healthy prefill"),
    ],
)
def test_a_transfer_that_fails_or_loses_its_notification_ends_clearly_and_frees_its_kv(
    tiny_models, decode, monkeypatch, spec, error
):
    model = tiny_models("llama")
    monkeypatch.setenv(ENV, spec)
    prefill = Server("prefill", model, *KV_TIMEOUT)
    monkeypatch.delenv(ENV)
    router = None
    try:
        prefill.wait_ready()
        decode.wait_ready()
        router = RouterProcess(model, [prefill], [decode])
        router.wait_ready()
        client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", timeout=60, max_retries=0)

        def ask(prompt):
            return client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0).choices[0].text

        outcomes = []
        for i in range(4):
            at = time.monotonic()
            try:
                outcomes.append(("ok", ask(f"request number {i}"), time.monotonic() - at))
            except openai.APIError as e:
                outcomes.append(("error", str(e), time.monotonic() - at))
        errors = [text for kind, text, _ in outcomes if kind == "error"]
        assert errors, f"no request met the injected fault: {outcomes}"
        assert all(re.search(error, text) for text in errors), errors
        assert all(waited < 20 for _, _, waited in outcomes), outcomes  # the bound: 3 s timeout + grace, not 600
        asyncio.run(wait_idle(decode, prefill))
        # The stack still serves, and right: of two more requests (faults still every other WRITE) one
        # gets through, with the text the clean first request got (none can where every WRITE fails).
        first = outcomes[0][1] if outcomes[0][0] == "ok" else None
        again = []
        for _ in range(2):
            try:
                again.append(ask("request number 0"))
            except openai.APIError as e:
                assert re.search(error, str(e))
        assert all(text == first for text in again) and (again or spec == "fail_write=1"), (first, again)
        asyncio.run(wait_idle(decode, prefill))
    finally:
        if router is not None:
            router.stop()
        prefill.stop()


def test_pages_that_fail_the_integrity_check_are_never_decoded_and_the_request_moves(tiny_models, monkeypatch):
    """--kv-integrity-check on two decode servers; the prefill server gets every other WRITE's checksum
    wrong (corrupt_sum=2, as if bytes had changed on the way). Each such request fails on its decode
    server before a token is decoded, and the router moves it to the other one, prefilled again: every
    client gets the clean answer, the decode servers count the failed checks, KV returns to idle."""
    from tests.test_trust import metric, metrics

    model = tiny_models("llama")
    monkeypatch.setenv(ENV, "corrupt_sum=2")
    prefill = Server("prefill", model)
    monkeypatch.delenv(ENV)
    decodes = [Server("decode", model, "--kv-integrity-check") for _ in range(2)]
    router = None
    try:
        for server in (prefill, *decodes):
            server.wait_ready()
        router = RouterProcess(model, [prefill], decodes)
        router.wait_ready()
        client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", timeout=60, max_retries=0)
        answers = [
            client.completions.create(model=model, prompt="the same prompt", max_tokens=8, temperature=0)
            .choices[0]
            .text
            for _ in range(4)
        ]
        assert len(set(answers)) == 1 and answers[0], answers
        failed = sum(
            metric(metrics(d.metrics_port), "pdserve_kv_rejected_transfers_total", role="decode", reason="checksum")
            for d in decodes
        )
        assert failed >= 2, failed  # (every other WRITE: the 2nd, 4th, ... of the first attempts and moves)
        asyncio.run(wait_idle(prefill, *decodes))
    finally:
        if router is not None:
            router.stop()
        for server in (*decodes, prefill):
            server.stop()


def test_an_interrupted_prefix_aware_transfer_unpins_its_prefix_and_the_turn_is_answered_again(
    tiny_models, monkeypatch
):
    """A conversation's second turn: the decode server holds the first turn's pages, so the prefill
    server sends only the rest, and that WRITE's notification is lost (every other WRITE's). Twice:
    with the prefix on the decode server's GPU, then evicted to its host tier and copied back for the
    turn. Each time the turn fails with the timeout, within its bound, and the decode server frees
    the pages it granted and unlocks the prefix it held (the pages it loaded back included); asked a
    third time, the turn gets its prefix hit and transformers' answer."""
    from pdserve.common.tokenizer import load_tokenizer
    from tests.test_disagg_engines import hf_greedy
    from tests.test_trust import metric, metrics

    model = tiny_models("llama")
    first = [1] + [(7 * i) % 500 + 5 for i in range(39)]  # 40 tokens: 2 whole pages of 16 cached after it
    filler = [1] + [(11 * i) % 500 + 5 for i in range(239)]  # 240 tokens: then the 256-token pool is all its
    second = first + hf_greedy(model, [first], 8)[0] + [33, 44, 55]
    monkeypatch.setenv(ENV, "drop_notif=2")  # WRITEs 2 and 4: the second turn's, before and after the filler
    prefill = Server("prefill", model, *KV_TIMEOUT)
    monkeypatch.delenv(ENV)
    pool = ("--max-total-tokens", "256", "--context-length", "256", "--host-kv-cache-gb", "0.01")
    decode = Server("decode", model, *KV_TIMEOUT, *pool)
    router = None
    try:
        prefill.wait_ready()
        decode.wait_ready()
        router = RouterProcess(model, [prefill], [decode])
        router.wait_ready()
        client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", timeout=60, max_retries=0)

        def ask(prompt):
            return client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0).choices[0].text

        def counter(name):
            return metric(metrics(decode.metrics_port), name)

        def hits():
            return counter("pdserve_kv_transfer_prefix_hit_tokens_total")

        def loaded():
            return counter("pdserve_host_kv_hit_tokens_total")

        assert ask(first)  # WRITE 1
        for where in ("device", "host"):
            if where == "host":
                ask(filler)  # WRITE 3; evicts the first turn's pages from the GPU: the host tier keeps them
            hits_before, loaded_before = hits(), loaded()
            at = time.monotonic()
            with pytest.raises(openai.APIError, match="KV transfer timed out"):
                ask(second)  # WRITEs 2 and 4, their notifications lost
            assert time.monotonic() - at < 20, where  # the 3 s timeout and its grace, not the deadline
            assert hits() > hits_before, where  # it was a prefix-aware transfer...
            assert (loaded() > loaded_before) == (where == "host")  # ...with its prefix back from host memory
            asyncio.run(wait_idle(decode, prefill))  # the grant freed, the prefix unlocked (kv_used counts locks)
        hits_before = hits()
        [want] = hf_greedy(model, [second], 8)
        assert ask(second) == load_tokenizer(model).decode(want, skip_special_tokens=True)  # WRITE 5
        assert hits() > hits_before
        asyncio.run(wait_idle(decode, prefill))
        disconnect_mid_transfer(router, prefill, decode, model)  # WRITE 6, its notification lost
    finally:
        if router is not None:
            router.stop()
        decode.stop()
        prefill.stop()


def disconnect_mid_transfer(router, prefill, decode, model):
    """A streaming client that leaves while its KV is on its way (the prefill done, the WRITE's
    notification lost, so the decode server still waits for it): the router cancels the request on
    the decode server, which answers it at once and frees its pages after the grace a late WRITE
    gets: not a failed transfer, as it would be at the transfer's timeout had nobody cancelled it."""
    from tests.test_servers import load
    from tests.test_trust import metric, metrics

    def prefilled():
        return metric(metrics(prefill.metrics_port), "pdserve_prefill_prompt_tokens_total")

    def failed_transfers():
        return metric(metrics(decode.metrics_port), "pdserve_kv_transfer_failures_total")

    before, failed = prefilled(), failed_transfers()
    body = json.dumps({"model": model, "prompt": [1, 5, 6, 7], "max_tokens": 8, "temperature": 0, "stream": True})
    host, port = router.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        conn.sendall(
            f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n{body}".encode()
        )
        deadline = time.monotonic() + 30
        while prefilled() == before or not asyncio.run(load(decode)).kv_used_tokens:  # mid-transfer
            assert time.monotonic() < deadline, "the request never reached its transfer"
            time.sleep(0.02)
    asyncio.run(wait_idle(decode, prefill))
    assert failed_transfers() == failed  # cancelled, not timed out
