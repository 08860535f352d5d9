"""Prefix-aware KV transfers: a decode server that holds the beginning of a prompt in its prefix
cache (a conversation's earlier turns) is sent only the pages after it (decode/scheduler.py,
prefill/scheduler.py). Engines in one process, KV moved by real NIXL (UCX, DRAM) WRITEs."""

import random

import pytest

from pdserve.common.scheduling.pages import pages_for
from pdserve.common.types import FinishReason, SamplingParams
from tests.test_disagg_engines import drive, engines, hf_greedy

PAGE = 8
MAX_NEW = 6


def conversations(n, seed=0):
    """First turns: a shared system prompt (3 pages) and a user message each."""
    rng = random.Random(seed)
    system = [0] + [rng.randrange(5, 512) for _ in range(3 * PAGE - 1)]
    return [system + [rng.randrange(5, 512) for _ in range(rng.randrange(3, 20))] for _ in range(n)]


def next_turns(prompts, outputs, seed):
    rng = random.Random(seed)
    return [p + o + [rng.randrange(5, 512) for _ in range(rng.randrange(2, 12))] for p, o in zip(prompts, outputs)]


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("aware", [True, False])
def test_a_next_turn_receives_only_the_pages_the_decode_server_lacks(tiny_models, overlap, aware):
    """Greedy output as transformers', turn after turn; from the second turn on the WRITE carries
    the pages after the previous turn's (the decode server's cache holds the earlier turns: their
    prompt and every output token but the last, whose KV no step computed), and with
    --disable-prefix-aware-transfers every page of every prompt crosses."""
    path = tiny_models("llama")
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0)
    kw = dict(disable_prefix_aware_transfers=not aware)
    prefill, decode = engines(path, overlap=overlap, decode_kw=kw)
    prompts = conversations(4)
    page_bytes, previous = None, None
    for turn in range(3):
        expected = hf_greedy(path, prompts, MAX_NEW)
        completions, results = drive(prefill, decode, prompts, [params] * len(prompts), seed=turn)
        outputs = [completions[f"r{i}"].output_ids for i in range(len(prompts))]
        assert outputs == expected
        sent = [results[f"r{i}"].transfer_bytes for i in range(len(prompts))]
        if page_bytes is None:  # the first turn: whole prompts (all admitted before any was cached)
            page_bytes = min(b // pages_for(len(p), PAGE) for b, p in zip(sent, prompts))
        for i, (nbytes, prompt) in enumerate(zip(sent, prompts)):
            assert nbytes % page_bytes == 0
            pages = nbytes // page_bytes
            if not aware:
                assert pages == pages_for(len(prompt), PAGE)
            elif turn > 0:
                held = (len(previous[i]) + MAX_NEW - 1) // PAGE  # the previous turn's whole pages
                assert pages == pages_for(len(prompt), PAGE) - min(held, (len(prompt) - 1) // PAGE)
        hits = decode.scheduler.stats["transfer_prefix_hit_tokens"]
        assert hits > 0 if aware and turn > 0 else hits == 0
        assert prefill.is_idle() and decode.is_idle() and decode.stats()["kv_used_tokens"] == 0
        previous, prompts = prompts, next_turns(prompts, outputs, seed=turn + 1)


def test_a_prefix_len_the_decode_server_did_not_grant_is_refused(tiny_models):
    """The prefix length reaches the prefill server through the router: one off a page boundary,
    not shorter than the prompt, or not matching the pages given is refused there; a consistent
    forgery (fewer pages, a longer prefix) is refused by the decode server, whose grant says how
    many pages it reads (the WRITE's count does not match): the request fails, nothing leaks."""
    path = tiny_models("llama")
    prefill, decode = engines(path, timeout=1.0)
    prompt = conversations(1)[0]
    params = SamplingParams(max_new_tokens=4, temperature=0)
    decode.add_decode_request(prompt, params, room=12345, rid="r0")
    decode.pop_preallocated()
    d = decode.destinations.popleft()
    assert d.prefix_len == 0 and len(d.page_ids) == pages_for(len(prompt), PAGE)
    add = lambda rid, prefix_len, pages: prefill.add_prefill_request(  # noqa: E731
        prompt, params, d.room, d.agent_metadata, pages, rid=rid, expires_unix_s=d.expires_unix_s, prefix_len=prefix_len
    )
    for prefix_len in (3, PAGE, len(prompt) + PAGE):  # off a page / pages not matching / past the prompt
        with pytest.raises(ValueError, match="prefix_len|pages"):
            add(f"bad{prefix_len}", prefix_len, d.page_ids)
    add("forged", PAGE, d.page_ids[1:])  # consistent, but not what the decode server granted
    import time

    from tests.test_disagg_engines import Stepper

    p_loop, d_loop, completions = Stepper(prefill), Stepper(decode), {}
    deadline = time.monotonic() + 30
    while "r0" not in completions:
        assert time.monotonic() < deadline
        p_loop.step()
        completions.update({c.rid: c for c in d_loop.step()})
    assert completions["r0"].error_code is not None and "timed out" in completions["r0"].error
    assert decode.rejected.get("page_count") == 1
    while decode.busy() or prefill.busy():
        assert time.monotonic() < deadline + 30
        p_loop.step()
        d_loop.step()
    assert decode.is_idle() and prefill.is_idle() and decode.stats()["kv_used_tokens"] == 0


@pytest.mark.parametrize("overlap", [True, False])
def test_a_prompt_the_decode_server_holds_whole_crosses_as_its_notification_alone(tiny_models, overlap):
    """A page-aligned prompt asked again (a regenerated answer): the decode server's cache holds
    every page of it, so it grants none and the prefill server's WRITE is the notification alone,
    which carries the first token; the answer is transformers' greedy one again."""
    path = tiny_models("llama")
    prompt = conversations(1)[0][: 3 * PAGE]
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0)
    [expected] = hf_greedy(path, [prompt], MAX_NEW)
    prefill, decode = engines(path, overlap=overlap)
    sent = []
    for attempt in range(2):
        completions, results = drive(prefill, decode, [prompt], [params], seed=attempt)
        assert completions["r0"].output_ids == expected and results["r0"].error is None
        sent.append(results["r0"].transfer_bytes)
        assert prefill.is_idle() and decode.is_idle() and decode.stats()["kv_used_tokens"] == 0
    assert sent[0] > 0 and sent[1] == 0
    assert decode.scheduler.stats["transfer_prefix_hit_tokens"] == len(prompt)


def test_under_kv_pressure_with_aborts_nothing_leaks_and_answers_stay_exact(tiny_models):
    """A pool too small for every conversation's history: cached prefixes are evicted, running
    requests retracted and prefilled again on the decode server, one request of each turn aborted
    mid-way; every answer that completes is transformers', and both servers end idle, every page
    free or cached and unlocked."""
    path = tiny_models("llama")
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0)
    # 32 pages of 8 on the decode side: fewer than a turn's 6 prompts of 4-8 pages and their answers need
    prefill, decode = engines(
        path, decode_kw=dict(max_total_tokens=32 * PAGE, max_running_requests=6, context_length=256)
    )
    prompts = conversations(6, seed=3)
    tree, evicted = decode.scheduler.kv.tree_cache, []
    evict = tree.evict
    tree.evict = lambda n: evicted.append(evict(n)) or evicted[-1]
    for turn in range(3):
        expected = hf_greedy(path, prompts, MAX_NEW)

        aborted = []

        def abort_one(step, turn=turn):
            if step == 3 + turn:
                aborted.append(decode.abort("r1"))  # None if it had finished already

        completions, _ = drive(prefill, decode, prompts, [params] * len(prompts), before_step=abort_one, seed=turn)
        if aborted[0] is not None:
            assert aborted[0].finish_reason is FinishReason.ABORT
            completions["r1"] = None
        outputs = []
        for i, want in enumerate(expected):
            if completions[f"r{i}"] is not None:
                assert completions[f"r{i}"].output_ids == want
            outputs.append(want)  # an aborted conversation goes on as if it had been answered
        assert prefill.is_idle() and decode.is_idle() and decode.stats()["kv_used_tokens"] == 0
        prompts = next_turns(prompts, outputs, seed=turn + 10)
    assert decode.scheduler.stats["transfer_prefix_hit_tokens"] > 0  # histories were reused...
    assert sum(evicted) > 0  # ...and others evicted to make room


def test_a_transfer_that_never_comes_frees_its_pages_and_unpins_the_prefix(tiny_models):
    """The prefill server dies with a next turn's WRITE pending: the decode server answers with a
    timeout, then (after the grace a late WRITE gets) frees the pages it granted and unlocks the
    prefix it pinned: the cached history is evictable again, not leaked."""
    import time

    from tests.test_disagg_engines import Stepper

    path = tiny_models("llama")
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0)
    prefill, decode = engines(path, timeout=1.0)
    [first] = conversations(1, seed=9)
    completions, _ = drive(prefill, decode, [first], [params])
    second = first + completions["r0"].output_ids + [11, 12, 13]
    tree = decode.scheduler.kv.tree_cache
    cached = tree.evictable_pages
    decode.add_decode_request(second, params, room=424242, rid="t2")
    d_loop = Stepper(decode)
    d_loop.step()
    [dest] = decode.destinations  # (never handed to a prefill server: it "died")
    assert dest.prefix_len > 0 and tree.protected_pages > 0 and tree.evictable_pages < cached
    done, deadline = {}, time.monotonic() + 30
    while decode.busy():
        assert time.monotonic() < deadline
        done.update({c.rid: c for c in d_loop.step()})
    assert "timed out" in done["t2"].error
    assert decode.is_idle() and decode.stats()["kv_used_tokens"] == 0
    assert tree.protected_pages == 0 and tree.evictable_pages == cached
