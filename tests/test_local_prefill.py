"""A decode server prefilling requests itself (issue 22's first step): GenerateRequest.local_prefill
puts a request in the decode scheduler's own prefill queue (chunked; no KV transfer), beside
disaggregated requests. Engine level here; through real servers and the router:
test_disagg_policy.py."""

import time

import pytest

from pdserve.common.scheduling.batch import ForwardMode
from pdserve.common.types import FinishReason, SamplingParams
from tests.test_disagg_engines import Stepper, drive, engines, hf_greedy, make_prompts


@pytest.mark.parametrize("overlap", [True, False])
def test_local_and_remote_prefills_in_one_run_match_transformers(tiny_models, overlap):
    path = tiny_models("qwen2")
    prompts = make_prompts(10, seed=4)
    expected = hf_greedy(path, prompts, 10)
    prefill, decode = engines(path, overlap=overlap, decode_kw=dict(chunked_prefill_size=16))
    params = [SamplingParams(max_new_tokens=10, temperature=0)] * len(prompts)
    local = {f"l{i}": ids for i, ids in enumerate(prompts) if i % 2 == 0}
    for rid, ids in local.items():
        decode.add_local_request(ids, params[0], rid=rid)
    remote = [ids for i, ids in enumerate(prompts) if i % 2 == 1]
    completions, results = drive(prefill, decode, remote, params[: len(remote)])
    loop = Stepper(decode)
    deadline = time.monotonic() + 60
    while decode.busy():  # (drive ran until both were idle; the local ones finished there too)
        assert time.monotonic() < deadline
        for c in loop.step():
            completions[c.rid] = c
    for i, ids in enumerate(prompts):
        rid = f"l{i}" if i % 2 == 0 else f"r{i // 2}"
        assert completions[rid].output_ids == expected[i], rid
    assert len(results) == len(remote), "only the remote requests went through the prefill server"
    assert decode.scheduler.stats["prefill_chunks"] > 0, "local prompts were chunked"
    assert prefill.is_idle() and decode.is_idle()


def test_prefill_chunks_alternate_with_decode_steps(tiny_models):
    """A long local prompt does not stall the running streams: between two of its chunks, the
    running requests take a decode step."""
    path = tiny_models("llama")
    _, decode = engines(path, decode_kw=dict(chunked_prefill_size=16))
    decode.add_local_request([0] + list(range(5, 12)), SamplingParams(max_new_tokens=40, temperature=0), rid="short")
    loop = Stepper(decode)
    while not decode.scheduler.running:
        loop.step()
    decode.add_local_request([0] + list(range(5, 200)), SamplingParams(max_new_tokens=4, temperature=0), rid="long")
    modes = []
    launch = decode.run_batch

    def recording(batch):
        modes.append(batch.mode)
        return launch(batch)

    decode.run_batch = recording
    done = {}
    while decode.busy():
        for c in loop.step():
            done[c.rid] = c
    extends = [i for i, m in enumerate(modes) if m is ForwardMode.EXTEND]
    assert len(extends) >= 10, "the long prompt was chunked"
    assert all(modes[i + 1] is ForwardMode.DECODE for i in extends[:-1]), modes
    assert {c.finish_reason for c in done.values()} == {FinishReason.LENGTH}
    assert decode.is_idle()


def test_aborted_local_prefills_leave_the_kv_idle(tiny_models):
    path = tiny_models("llama")
    _, decode = engines(path, decode_kw=dict(chunked_prefill_size=16))
    for i in range(6):
        decode.add_local_request([0] + list(range(5, 5 + 20 * (i + 1))), SamplingParams(max_new_tokens=50), rid=f"a{i}")
    loop = Stepper(decode)
    for step in range(8):  # some queued, some mid-prompt, some decoding
        loop.step()
        if step == 3:
            decode.abort("a0")
    for i in range(1, 6):
        decode.abort(f"a{i}")
    while decode.busy():
        loop.step()
    assert decode.is_idle() and decode.stats()["kv_used_tokens"] == 0


def test_prompt_logprobs_are_refused_for_a_local_prefill(tiny_models):
    _, decode = engines(tiny_models("llama"))
    with pytest.raises(ValueError, match="prompt_logprobs"):
        decode.add_local_request([0, 5, 6], SamplingParams(prompt_logprobs=1))
    assert decode.is_idle()


def test_a_local_prefill_starts_from_the_decode_servers_prefix_cache(tiny_models):
    """What a request left in the decode server's cache (transferred or computed there) serves a
    later local prefill of the same prefix."""
    path = tiny_models("qwen2")
    prefill, decode = engines(path, decode_kw=dict(chunked_prefill_size=16))
    shared = make_prompts(1, seed=9)[0] + list(range(100, 140))
    first, second = shared + [7, 8], shared + [9, 10, 11]
    expected = hf_greedy(path, [first, second], 6)
    params = SamplingParams(max_new_tokens=6, temperature=0)
    completions, _ = drive(prefill, decode, [first], [params])  # remote: its KV came by transfer
    assert completions["r0"].output_ids == expected[0]
    decode.add_local_request(second, params, rid="local")
    loop, done = Stepper(decode), {}
    while decode.busy():
        for c in loop.step():
            done[c.rid] = c
    assert done["local"].output_ids == expected[1]
    assert done["local"].cached_tokens >= len(shared) - decode.config.page_size
    assert prefill.is_idle() and decode.is_idle()


class _Channel:
    """The scheduler process's channel, as the event loop uses it: nothing to receive, sends kept."""

    def __init__(self):
        self.sent = []

    def send(self, msg) -> None:
        self.sent.append(msg)

    def recv(self, block: bool = False) -> list:
        return []


@pytest.mark.parametrize("interval", [1, 3])
def test_stream_interval_sends_every_nth_token_and_the_first_and_last_at_once(tiny_models, interval):
    """--stream-interval (SGLang's): a stream's first token goes at once (its TTFT), then every
    `interval` tokens, and what is left with its finish; the tokens are all there, in order."""
    from pdserve.common.serving import ipc

    _, decode = engines(tiny_models("llama"), decode_kw=dict(stream_interval=interval))
    decode.channel = channel = _Channel()
    req = decode.add_local_request([0, 5, 6, 7], SamplingParams(max_new_tokens=11, temperature=0), rid="a")
    decode.streaming["a"] = [req, 0]  # as process_input_requests registers a request from the frontend
    loop = Stepper(decode)
    deadline = time.monotonic() + 60
    while decode.busy():
        assert time.monotonic() < deadline
        loop.step()
    chunks = []
    for msg in channel.sent:
        chunks += msg.chunks if isinstance(msg, ipc.StepTokens) else [msg] if isinstance(msg, ipc.Tokens) else []
    sizes = [len(c.token_ids) for c in chunks]
    assert sizes[0] == 1 and all(size == interval for size in sizes[1:-1]) and 1 <= sizes[-1] <= interval, sizes
    assert [c.index for c in chunks] == [sum(sizes[:i]) for i in range(len(sizes))]
    assert [t for c in chunks for t in c.token_ids] == req.output_ids and len(req.output_ids) == 11
    assert isinstance(channel.sent[-1], ipc.Finished)
