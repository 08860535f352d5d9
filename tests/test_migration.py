"""As what request a choice moves to another decode server when its own fails (router/migration.py).
That the servers continue such a request exactly: tests/test_resumed_output.py; the moves themselves,
between real processes: tests/test_faults.py."""

import asyncio
from types import SimpleNamespace

from pdserve.common.types import FinishReason, SamplingParams
from pdserve.router import app as router_app
from pdserve.router.app import Router, RouterConfig
from pdserve.router.migration import resumed
from pdserve.router.pairing import Event, UpstreamError


def test_a_choice_resumes_with_its_sent_tokens_as_prompt_and_the_rest_of_its_budget():
    params = SamplingParams(max_new_tokens=10, min_new_tokens=4, temperature=0, prompt_logprobs=2, logprobs=1)
    prompt, left = resumed([1, 2, 3], [7, 8, 9], params)
    assert prompt == [1, 2, 3, 7, 8, 9]
    assert (left.max_new_tokens, left.min_new_tokens, left.prompt_logprobs, left.logprobs) == (7, 1, None, 1)
    _, done_min = resumed([1], [5] * 6, params)
    assert done_min.min_new_tokens == 0 and done_min.max_new_tokens == 4


def test_the_sent_tokens_are_marked_as_output_already_produced():
    """Whatever the request's parameters (a grammar, output-only penalties, a seed): the servers continue it
    from the count of output tokens it carries (SamplingParams.resumed_output_tokens)."""
    params = SamplingParams(
        max_new_tokens=10, temperature=0.7, seed=5, frequency_penalty=0.5, grammar=("json_object", "")
    )
    prompt, left = resumed([1, 2, 3], [7, 8, 9], params)
    assert left.resumed_output_tokens == 3 and prompt[-3:] == [7, 8, 9]
    assert (left.seed, left.frequency_penalty, left.grammar) == (5, 0.5, ("json_object", ""))
    assert resumed(prompt, [4], left)[1].resumed_output_tokens == 4  # (a request moved again counts on)


def test_a_moved_choice_ends_at_a_stop_string_that_spans_the_move_with_the_whole_usage(tiny_models, monkeypatch):
    """The router's choice() over a decode stream that breaks after SENT tokens (its server killed) and a
    second one on another decode server, which starts after them and knows nothing of the stop string's
    start (its own text begins at the move): the router matches stop strings on the whole output, so
    the choice ends where the uninterrupted run would, and its deltas and usage cover every token."""
    router = Router(RouterConfig(tiny_models("llama"), ("127.0.0.1:1",), ("127.0.0.1:2", "127.0.0.1:3")))
    prompt, tokens, sent = [5, 6, 7], list(range(300, 340)), 10
    text = router.tokenizer.decode(tokens)
    cut = len(router.tokenizer.decode(tokens[:sent]))
    stop = text[cut - 2 : cut + 2]  # two characters before the move, two after
    assert stop and text.index(stop) == cut - 2
    params = SamplingParams(max_new_tokens=len(tokens), temperature=0.7, seed=3, ignore_eos=True, stop=(stop,))
    asked = []

    async def fake_paired_generate(channel, pick_prefill, report, prompt_ids, params, config):
        asked.append((prompt_ids, params))
        if len(asked) == 1:  # the first decode server: SENT tokens, then the call breaks
            yield Event("tokens", tokens[:sent], 0, cached_tokens=0)
            raise UpstreamError(
                "decode server 127.0.0.1:2 failed: unavailable", decode_failed=True, reason="unavailable"
            )
        for i, token in enumerate(tokens[sent:]):  # the second: the rest, one token per event
            yield Event("tokens", [token], i, cached_tokens=0 if i == 0 else None)
        yield Event("finish", [])

    workers = {url: SimpleNamespace(channel=None, inflight=0) for url in ("decode-0", "decode-1")}
    monkeypatch.setattr(router_app, "paired_generate", fake_paired_generate)
    monkeypatch.setattr(router, "pick", lambda role, ids, exclude=(): "decode-1" if exclude else "decode-0")
    monkeypatch.setattr(router.registry, "workers", workers)
    monkeypatch.setattr(router, "decode_target", lambda url: None)
    monkeypatch.setattr(router.registry, "record", lambda url, ok: None)
    deltas = []

    async def on_text(delta, logprobs):
        deltas.append(delta)

    completion = asyncio.run(router.choice(prompt, params, on_text))
    assert [(p, q.resumed_output_tokens, q.max_new_tokens) for p, q in asked[1:]] == [
        (prompt + tokens[:sent], sent, len(tokens) - sent)
    ]
    assert completion.finish_reason is FinishReason.STOP and completion.matched_stop == stop
    assert completion.text == text[: cut - 2] == "".join(deltas)
    # Usage (common/openai/format.py) counts the completion's ids: the client's prompt, every output token.
    ends = next(n for n in range(len(tokens)) if stop in router.tokenizer.decode(tokens[:n]))  # (after the move)
    assert completion.prompt_ids == prompt and completion.output_ids == tokens[:ends] and ends > sent
