"""The router's choice() when the decode stream delivers several tokens per message.

A decode server whose stream fell behind merges queued token chunks (decode/server.py), so one
event may carry many tokens. Stop rules still apply token by token, the text and logprobs still
come out exactly as with one token per event, and a stream gets one delta per event. Streamed
deltas add up to the final text even when a stop string spans tokens: text a stop string could
still claim is held back (before, a stream sent the first part of a stop string).
"""

import asyncio
from types import SimpleNamespace

import pytest

from pdserve.common.serving import ipc
from pdserve.common.types import SamplingParams, TokenLogprob
from pdserve.decode.server import _merge_queued_tokens
from pdserve.router import app as router_app
from pdserve.router.app import Router, RouterConfig
from pdserve.router.pairing import Event


def run_choice(router, monkeypatch, token_ids, per_event, params):
    """choice() over a fake decode stream of `token_ids` in events of `per_event` tokens."""

    async def fake_paired_generate(channel, pick_prefill, report, prompt_ids, params, config):
        for i in range(0, len(token_ids), per_event):
            ids = token_ids[i : i + per_event]
            yield Event(
                "tokens",
                ids,
                i,
                [TokenLogprob(t, -0.5 - t / 1000, []) for t in ids],
                cached_tokens=2 if i == 0 else None,
            )
        yield Event("finish", [])

    monkeypatch.setattr(router_app, "paired_generate", fake_paired_generate)
    monkeypatch.setattr(router, "pick", lambda role, ids, exclude=(): "decode-0")
    monkeypatch.setattr(router.registry, "workers", {"decode-0": SimpleNamespace(channel=None, inflight=0)})
    monkeypatch.setattr(router, "decode_target", lambda url: None)
    monkeypatch.setattr(router.registry, "record", lambda url, ok: None)
    deltas = []

    async def on_text(delta, logprobs):
        deltas.append((delta, [lp.token_id for lp in logprobs]))

    completion = asyncio.run(router.choice([5, 6, 7], params, on_text))
    return completion, deltas


@pytest.fixture
def router(tiny_models):
    return Router(RouterConfig(tiny_models("llama"), ("127.0.0.1:1",), ("127.0.0.1:2",)))


@pytest.mark.parametrize("stop", [(), ("x",)])
def test_merged_token_chunks_give_the_same_answer_as_single_tokens(router, monkeypatch, stop):
    tokens = list(range(300, 340))
    text = router.tokenizer.decode(tokens)
    if stop:  # a stop string that ends the answer in the middle of a merged chunk
        stop = (text[len(text) // 2 : len(text) // 2 + 3],)
    params = SamplingParams(max_new_tokens=len(tokens), temperature=0, ignore_eos=True, stop=stop, logprobs=0)
    one, one_deltas = run_choice(router, monkeypatch, tokens, 1, params)
    merged, merged_deltas = run_choice(router, monkeypatch, tokens, 16, params)
    assert (merged.text, merged.output_ids, merged.finish_reason) == (one.text, one.output_ids, one.finish_reason)
    assert merged.cached_tokens == one.cached_tokens == 2  # what the prefill server had cached
    assert [lp.token_id for lp in merged.logprobs] == [lp.token_id for lp in one.logprobs] == one.output_ids
    if stop:
        assert merged.finish_reason.value == "stop" and len(merged.output_ids) < len(tokens)
    for deltas in (one_deltas, merged_deltas):  # the deltas add up to the answer, each token's logprob once
        assert "".join(d for d, _ in deltas) == one.text
        assert [t for _, ids in deltas for t in ids] == one.output_ids
    assert len(merged_deltas) <= -(-len(tokens) // 16) < len(one_deltas)


def test_queued_token_chunks_merge_until_a_gap_or_another_message():
    async def scenario():
        queue = asyncio.Queue()
        for msg in (
            ipc.Tokens("r", 3, [7, 8], [(7, -1.0, []), (8, -1.0, [])]),
            ipc.Tokens("r", 5, [9], [(9, -2.0, [])]),
            ipc.Finished("r", "length", 4, 6),
            ipc.Tokens("r", 9, [1]),
        ):
            queue.put_nowait(msg)
        first = queue.get_nowait()
        merged, held = _merge_queued_tokens(first, queue)
        assert (merged.index, merged.token_ids, [lp[0] for lp in merged.logprobs]) == (3, [7, 8, 9], [7, 8, 9])
        assert isinstance(held, ipc.Finished) and queue.qsize() == 1
        gap = ipc.Tokens("r", 20, [2])
        queue.put_nowait(ipc.Tokens("r", 22, [3]))  # not contiguous with index 20 + 1: kept apart
        queue.get_nowait()  # drop the stale Tokens(9)
        merged, held = _merge_queued_tokens(gap, queue)
        assert merged.token_ids == [2] and held.index == 22
        merged, held = _merge_queued_tokens(ipc.Tokens("r", 0, [4]), queue)
        assert merged.token_ids == [4] and held is None

    asyncio.run(scenario())
