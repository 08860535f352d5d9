"""Where a request's time goes, through real servers and the router: the stage breakdown an answer
carries when asked ("return_timings"), the router's request log line, and each server's stage
histograms (router/timings.py, decode/timings.py, common/serving/server_metrics.py)."""

import re
import time

import pytest

from pdserve.router.timings import STAGES
from tests.router_stack import RouterProcess, send
from tests.test_servers import Server
from tests.test_trust import metric

# The stages that run one after another before the first token reaches the router.
BEFORE_FIRST_TOKEN = ("router_queue_s", "prefill_queue_s", "prefill_s", "destination_wait_s", "transfer_s")
SLACK_S = 0.002  # the breakdown's rounding, and two processes' clocks read a moment apart


@pytest.fixture(scope="module")
def stack(tiny_models):
    model = tiny_models("llama")
    decode, prefill = Server("decode", model), Server("prefill", model)
    router = None
    try:
        decode.wait_ready()
        prefill.wait_ready()
        router = RouterProcess(model, [prefill], [decode], "--log-level", "info")
        router.wait_ready()
        yield model, prefill, decode, router
    finally:
        if router is not None:
            router.stop()
        prefill.stop()
        decode.stop()


def check_breakdown(timings: dict, wall_s: float) -> None:
    """Every stage present and non-negative, and adding up: the serial stages fit in the time to the
    first token, which with the decode makes the total, itself within what the client waited."""
    assert list(timings) == list(STAGES), timings
    assert all(seconds >= 0 for seconds in timings.values()), timings
    assert timings["prefill_s"] > 0 and timings["transfer_s"] > 0, timings  # a real prefill and transfer
    assert sum(timings[s] for s in BEFORE_FIRST_TOKEN) <= timings["first_token_s"] + SLACK_S, timings
    assert abs(timings["first_token_s"] + timings["decode_s"] - timings["total_s"]) <= SLACK_S, timings
    assert timings["slot_wait_s"] <= timings["decode_s"] + SLACK_S, timings
    assert 0 < timings["total_s"] <= wall_s, (timings, wall_s)


def test_answers_carry_the_stage_breakdown_only_when_asked(stack):
    _, _, _, router = stack
    body = {"prompt": [1, 5, 9, 13, 17, 21], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    plain = send(router.url, "/v1/completions", body)
    assert plain.status == 200 and "timings" not in plain.json["choices"][0], plain
    for n in (1, 2):
        started = time.monotonic()
        answer = send(router.url, "/v1/completions", body | {"n": n, "return_timings": True})
        wall = time.monotonic() - started
        assert answer.status == 200, answer
        for choice in answer.json["choices"]:
            check_breakdown(choice["timings"], wall)
    # Streamed: the finish chunk carries it (chat).
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "ignore_eos": True, "stream": True}
    started = time.monotonic()
    streamed = send(router.url, "/v1/chat/completions", chat | {"return_timings": True})
    wall = time.monotonic() - started
    finishes = [e["choices"][0] for e in streamed.events if e != "[DONE]" and e["choices"][0]["finish_reason"]]
    assert len(finishes) == 1, streamed
    check_breakdown(finishes[0]["timings"], wall)
    assert not any("timings" in e["choices"][0] for e in send(router.url, "/v1/chat/completions", chat).events[:-1])
    # /generate: at the top of the answer.
    started = time.monotonic()
    native = {"input_ids": [1, 4, 8], "sampling_params": {"max_tokens": 5, "ignore_eos": True}, "return_timings": True}
    generated = send(router.url, "/generate", native)
    check_breakdown(generated.json["timings"], time.monotonic() - started)
    refused = send(router.url, "/v1/completions", body | {"return_timings": "yes"})
    assert refused.status == 400 and "return_timings" in refused.json["error"]["message"], refused


def test_the_request_log_line_carries_the_breakdown(stack):
    _, _, _, router = stack
    body = {"prompt": [1, 6, 7], "max_tokens": 4, "ignore_eos": True}
    assert send(router.url, "/v1/completions", body).status == 200
    deadline = time.monotonic() + 10
    pattern = r"request \w+: completion, 3 prompt tokens x 1 choices -> 200; 4 completion tokens.*; stages ms: (.*)"
    while not (found := re.findall(pattern, router.output())) and time.monotonic() < deadline:
        time.sleep(0.1)  # (the router's log is a file: its lines arrive a moment later)
    assert found, router.output()[-2000:]
    stages = dict(part.split(" ") for part in found[-1].split(", "))
    assert list(stages) == [s.removesuffix("_s") for s in STAGES], found[-1]
    assert all(float(v) >= 0 for v in stages.values()) and float(stages["total"]) > 0, found[-1]


def test_each_server_histograms_the_stages_it_ran(stack):
    _, prefill, decode, router = stack
    body = {"prompt": [1, 30, 31, 32], "max_tokens": 5, "ignore_eos": True}
    before_p, before_d = prefill.metrics(), decode.metrics()
    for _ in range(3):
        assert send(router.url, "/v1/completions", body).status == 200
    time.sleep(0.2)  # (the last Finished reaches the decode frontend as its answer is sent)
    after_p, after_d = prefill.metrics(), decode.metrics()

    def grew(before: str, after: str, name: str, role: str) -> float:
        count = metric(after, name + "_count", role=role) - metric(before, name + "_count", role=role)
        assert metric(after, name + "_sum", role=role) >= 0
        return count

    for name in ("request_queue", "prefill_compute", "kv_destination_wait", "kv_transfer"):
        assert grew(before_p, after_p, f"pdserve_{name}_seconds", "prefill") == 3, name
    for name in ("request_queue", "kv_wait", "decode_slot_wait", "decode_first_token", "decode"):
        assert grew(before_d, after_d, f"pdserve_{name}_seconds", "decode") == 3, name
    # A decode server prefills nothing here: its local-prefill histogram stays empty.
    assert grew(before_d, after_d, "pdserve_prefill_compute_seconds", "decode") == 0
    assert metric(after_d, "pdserve_decode_seconds_sum", role="decode") > 0
