"""Exact tests of the scheduler: admission, batch layout, page growth, finishing, aborts, chunked
prefill, prefix-cache hits, retraction.

No model runs here: the tests play the model by feeding chosen tokens to process_batch_result.
"""

import pytest
import torch

from pdserve.common.config import EngineConfig
from pdserve.common.engine.batch_builder import BatchBuilder
from pdserve.common.engine.kv_pool import PagedKVPool, ReqToTokenPool
from pdserve.common.scheduling.batch import ForwardMode
from pdserve.common.scheduling.scheduler import Scheduler
from pdserve.common.types import FinishReason, Req, SamplingParams

EOS = 99


def make_scheduler(
    num_pages=10,
    page_size=4,
    rows=4,
    context=32,
    max_running=4,
    max_prefill=64,
    chunk=0,
    radix=False,
    reserve=512,
    policy="fcfs",
):
    config = EngineConfig(
        model_path="unused",
        context_length=context,
        max_running_requests=max_running,
        max_prefill_tokens=max_prefill,
        page_size=page_size,
        chunked_prefill_size=chunk,
        disable_radix_cache=not radix,
        num_reserved_decode_tokens=reserve,
        schedule_policy=policy,
    )
    r2t = ReqToTokenPool(rows, context, "cpu")
    kv = PagedKVPool(num_pages, page_size, num_layers=1, kv_heads=1, head_dim=2, dtype=torch.float32, device="cpu")
    return Built(Scheduler(config, r2t, kv, eos_token_ids=(EOS,)), BatchBuilder(r2t, page_size))


class Built:
    """The scheduler, with each batch it picks built into device tensors by the batch builder, as
    the engine does: the tests check the layout the model would see."""

    def __init__(self, scheduler, builder):
        self.scheduler, self.builder = scheduler, builder

    def get_next_batch_to_run(self):
        batch = self.scheduler.get_next_batch_to_run()
        return None if batch is None else self.builder.build(batch)

    def __getattr__(self, name):
        return getattr(self.scheduler, name)


def req(rid, prompt_len, max_new=4, **kw):
    return Req(rid, list(range(10, 10 + prompt_len)), SamplingParams(max_new_tokens=max_new, **kw), seed=0)


def feed(s, batch, tokens):
    """Play the model serially: launch the batch, then process its result at once."""
    s.on_launched(batch, list(range(1, batch.batch_size + 1)))
    return s.process_batch_result(batch, tokens, [None] * len(tokens))


def test_prefill_batch_layout_is_exact():
    s = make_scheduler()
    a, b, c = req("a", 5), req("b", 3), req("c", 9)
    for r in (a, b, c):
        s.add_request(r)
    batch = s.get_next_batch_to_run()
    assert batch.mode is ForwardMode.EXTEND and batch.reqs == [a, b, c]
    assert (a.req_pool_idx, b.req_pool_idx, c.req_pool_idx) == (0, 1, 2)
    assert (a.pages, b.pages, c.pages) == ([1, 2], [3], [4, 5, 6])
    assert batch.input_ids.tolist() == a.prompt_ids + b.prompt_ids + c.prompt_ids
    assert batch.positions.tolist() == [0, 1, 2, 3, 4, 0, 1, 2] + list(range(9))
    assert batch.out_cache_loc.tolist() == [4, 5, 6, 7, 8] + [12, 13, 14] + list(range(16, 25))
    assert batch.seq_lens == [5, 3, 9] and batch.extend_lens == [5, 3, 9] and batch.extend_starts == [0, 5, 8]
    assert batch.last_token_indices() == [4, 7, 16]
    assert s.req_to_token_pool.req_to_token[0, :5].tolist() == [4, 5, 6, 7, 8]
    assert s.req_to_token_pool.req_to_token[2, :9].tolist() == list(range(16, 25))
    assert list(s.waiting) == []


def test_decode_steps_grow_pages_at_page_boundaries():
    s = make_scheduler()
    a, b = req("a", 3), req("b", 4)
    s.add_request(a)
    s.add_request(b)
    feed(s, s.get_next_batch_to_run(), [50, 51])
    assert s.running == [a, b] and (a.pages, b.pages) == ([1], [2])
    batch = s.get_next_batch_to_run()
    # a: token 50 at position 3 (still page 1); b: token 51 at position 4 -> new page 3
    assert batch.mode is ForwardMode.DECODE
    assert batch.input_ids.tolist() == [50, 51] and batch.positions.tolist() == [3, 4]
    assert b.pages == [2, 3] and batch.out_cache_loc.tolist() == [7, 12]
    assert batch.seq_lens == [4, 5] and batch.extend_lens == [1, 1] and batch.extend_starts == [0, 1]
    feed(s, batch, [60, 61])
    batch = s.get_next_batch_to_run()
    assert a.pages == [1, 4] and batch.out_cache_loc.tolist() == [16, 13]
    assert a.output_ids == [50, 60] and a.kv_len == 5  # kv_len counts positions launched


def test_finished_requests_free_their_row_and_pages_and_leave_running():
    s = make_scheduler()
    a, b = req("a", 3, max_new=2), req("b", 3, max_new=5)
    s.add_request(a)
    s.add_request(b)
    assert feed(s, s.get_next_batch_to_run(), [1, EOS])[0].finish_reason is FinishReason.STOP
    assert s.running == [a] and s.req_to_token_pool.available() == 3
    [done] = feed(s, s.get_next_batch_to_run(), [2])
    assert done.rid == "a" and done.finish_reason is FinishReason.LENGTH and done.output_ids == [1, 2]
    assert s.running == [] and s.is_idle()


def test_admission_reserves_whole_sequences_and_is_fcfs():
    # 9 usable pages of 4 tokens. a needs (8+4)/4 = 3 pages, b (20+4)/4 = 6, c (1+4)/4 = 2.
    s = make_scheduler()
    a, b, c = req("a", 8), req("b", 20), req("c", 1)
    for r in (a, b, c):
        s.add_request(r)
    batch = s.get_next_batch_to_run()
    assert batch.reqs == [a, b]  # c does not fit the 0 pages left
    assert list(s.waiting) == [c]
    feed(s, batch, [1, 2])
    # b holds 5 pages with 1 more promised, a holds 2 with 1 promised: nothing free for c yet.
    assert s.get_next_batch_to_run().mode is ForwardMode.DECODE


def test_head_of_queue_blocks_smaller_requests_behind_it():
    s = make_scheduler(num_pages=5)  # 4 usable pages
    s.add_request(req("a", 8))  # 3 pages
    s.add_request(req("big", 9))  # 4 pages: waits
    s.add_request(req("small", 1))  # 2 pages: would fit, but fcfs
    batch = s.get_next_batch_to_run()
    assert [r.rid for r in batch.reqs] == ["a"]
    assert [r.rid for r in s.waiting] == ["big", "small"]


def test_max_running_and_max_prefill_tokens_limit_a_prefill_batch():
    s = make_scheduler(num_pages=40, max_running=2)
    for i in range(3):
        s.add_request(req(f"r{i}", 2))
    assert [r.rid for r in s.get_next_batch_to_run().reqs] == ["r0", "r1"]

    s = make_scheduler(num_pages=40, max_prefill=10)
    for i in range(3):
        s.add_request(req(f"r{i}", 4))
    assert [r.rid for r in s.get_next_batch_to_run().reqs] == ["r0", "r1"]
    assert [r.rid for r in s.get_next_batch_to_run().reqs] == ["r2"]  # prefill first, before decode


def test_a_prompt_longer_than_max_prefill_tokens_still_runs_alone():
    s = make_scheduler(num_pages=40, max_prefill=4)
    s.add_request(req("long", 9))
    assert s.get_next_batch_to_run().extend_lens == [9]


def test_abort_frees_wherever_the_request_is():
    s = make_scheduler()
    a, b = req("a", 3), req("b", 3)
    s.add_request(a)
    feed(s, s.get_next_batch_to_run(), [1])
    s.add_request(b)
    assert s.abort("b").finish_reason is FinishReason.ABORT  # still waiting
    assert s.abort("a").finish_reason is FinishReason.ABORT  # running, holding KV
    assert s.abort("nope") is None
    assert s.is_idle()


def test_requests_that_can_never_fit_are_refused_up_front():
    s = make_scheduler(num_pages=3, context=64)
    with pytest.raises(ValueError, match="context length"):
        s.add_request(req("a", 60, max_new=10))
    with pytest.raises(ValueError, match="whole pool"):
        s.add_request(req("b", 9, max_new=4))
    assert s.is_idle()


def test_chunked_prefill_runs_a_long_prompt_in_chunks_outside_both_queues():
    s = make_scheduler(num_pages=20, chunk=4)
    a = req("a", 10)
    s.add_request(a)
    first = s.get_next_batch_to_run()
    assert first.positions.tolist() == [0, 1, 2, 3] and first.seq_lens == [4] and a.pages == [1]
    assert feed(s, first, [77]) == []
    assert s.chunked_req is a and a not in s.running and not s.waiting and a.output_ids == []  # token dropped
    second = s.get_next_batch_to_run()
    assert second.mode is ForwardMode.EXTEND and second.positions.tolist() == [4, 5, 6, 7] and a.pages == [1, 2]
    feed(s, second, [78])
    third = s.get_next_batch_to_run()
    assert third.positions.tolist() == [8, 9] and third.input_ids.tolist() == a.prompt_ids[8:]
    assert a.pages == [1, 2, 3] and s.req_to_token_pool.req_to_token[0, :10].tolist() == list(range(4, 14))
    feed(s, third, [79])
    assert s.chunked_req is None and s.running == [a] and a.output_ids == [79]
    assert s.stats["prefill_chunks"] == 2


def test_a_chunk_shares_the_batch_with_whole_prompts_and_prefill_goes_first():
    s = make_scheduler(num_pages=30, chunk=8)
    a, b, c = req("a", 3), req("b", 10), req("c", 2)
    for r in (a, b, c):
        s.add_request(r)
    batch = s.get_next_batch_to_run()
    assert batch.reqs == [a, b] and batch.extend_lens == [3, 5]  # b gets the 5 tokens left of the budget
    feed(s, batch, [1, 2])
    batch = s.get_next_batch_to_run()
    assert batch.reqs == [b, c] and batch.extend_lens == [5, 2]  # b's last chunk, then c
    feed(s, batch, [3, 4])
    assert s.running == [a, b, c] and b.output_ids == [3]


def test_prefix_cache_hit_reuses_whole_pages_and_counts_cached_tokens():
    s = make_scheduler(num_pages=20, radix=True)
    a = Req("a", [5, 6, 7, 8, 9, 10, 11, 12, 13], SamplingParams(max_new_tokens=1), seed=0)
    s.add_request(a)
    feed(s, s.get_next_batch_to_run(), [40])  # finishes at max_new_tokens: 2 full pages cached
    assert a.pages == [] and s.tree_cache.evictable_pages == 2 and s.kv_pool.num_free_pages() == 17
    b = Req("b", [5, 6, 7, 8, 9, 10, 11, 12, 50, 51], SamplingParams(max_new_tokens=2), seed=0)
    s.add_request(b)
    batch = s.get_next_batch_to_run()
    assert b.pages[:2] == [1, 2] and b.prefix_pages == 2 and b.cached_tokens == 8 and b.kv_len == 10
    assert batch.positions.tolist() == [8, 9] and batch.input_ids.tolist() == [50, 51] and batch.seq_lens == [10]
    assert s.req_to_token_pool.req_to_token[b.req_pool_idx, :10].tolist() == list(range(4, 12)) + [
        b.pages[2] * 4,
        b.pages[2] * 4 + 1,
    ]
    assert s.tree_cache.protected_pages == 2 and s.tree_cache.evictable_pages == 0
    feed(s, batch, [41])
    feed(s, s.get_next_batch_to_run(), [42])
    assert s.is_idle() and s.stats["cache_hit_tokens"] == 8


def test_a_fully_cached_prompt_still_computes_its_last_token():
    s = make_scheduler(num_pages=20, radix=True)
    for rid in ("a", "b"):
        s.add_request(Req(rid, list(range(20, 28)), SamplingParams(max_new_tokens=1), seed=0))
        batch = s.get_next_batch_to_run()
        feed(s, batch, [1])
    # b matched only the first page: 8 tokens are cached but the last one must be recomputed
    assert batch.positions.tolist() == [4, 5, 6, 7] and s.is_idle()


def test_lpm_puts_the_longest_cached_prefix_first():
    s = make_scheduler(num_pages=40, radix=True, policy="lpm", max_running=1)
    s.add_request(Req("warm", list(range(100, 112)), SamplingParams(max_new_tokens=1), seed=0))
    feed(s, s.get_next_batch_to_run(), [1])
    s.add_request(Req("cold", list(range(200, 210)), SamplingParams(max_new_tokens=1), seed=0))
    s.add_request(Req("hot", list(range(100, 110)), SamplingParams(max_new_tokens=1), seed=0))
    assert [r.rid for r in s.get_next_batch_to_run().reqs] == ["hot"]


def test_cached_pages_are_evicted_lru_when_admission_needs_them():
    s = make_scheduler(num_pages=9, radix=True)  # 8 usable pages
    for i, rid in enumerate(("old", "new")):
        s.add_request(Req(rid, list(range(30 * i, 30 * i + 12)), SamplingParams(max_new_tokens=1), seed=0))
        feed(s, s.get_next_batch_to_run(), [1])
    # old cached pages 1-3 (its 4th, partial, was freed), new 4-6; 7 and 8 never used
    assert s.tree_cache.evictable_pages == 6 and s.kv_pool.num_free_pages() == 2
    s.add_request(Req("big", list(range(300, 316)), SamplingParams(max_new_tokens=4), seed=0))
    batch = s.get_next_batch_to_run()  # 4 pages now (5 with its reserve): evicts the LRU leaf "old"
    assert batch.reqs[0].rid == "big" and batch.reqs[0].pages == [7, 8, 1, 2]
    assert s.tree_cache.cached_prefix_len(list(range(0, 12))) == 0
    assert s.tree_cache.cached_prefix_len(list(range(30, 42))) == 12


def test_retraction_frees_kv_and_resumes_with_the_output_so_far():
    # 6 usable pages of 4; two requests of prompt 4 admitted with 4 reserved decode tokens each.
    s = make_scheduler(num_pages=7, reserve=4)
    a = req("a", 4, max_new=12)
    b = req("b", 4, max_new=12)
    s.add_request(a)
    s.add_request(b)
    feed(s, s.get_next_batch_to_run(), [1, 2])
    steps = 0
    while True:
        batch = s.get_next_batch_to_run()
        assert batch.mode is ForwardMode.DECODE
        if s.stats["retractions"]:
            break
        feed(s, batch, [3] * batch.batch_size)
        steps += 1
    assert steps == 8 and batch.reqs == [a]
    # a and b hold 3 pages each after 8 tokens; both need a 4th with nothing free: b (admitted
    # last, ties on output) goes back to the head of the queue with its tokens, holding nothing.
    assert s.running == [a] and list(s.waiting) == [b] and b.pages == [] and b.req_pool_idx is None
    assert b.output_ids == [2] + [3] * steps and b.kv_len == 0
    while s.has_work():
        batch = s.get_next_batch_to_run()
        if batch.reqs == [b] and batch.mode is ForwardMode.EXTEND:
            assert batch.input_ids.tolist() == b.prompt_ids + b.output_ids  # prompt + output recomputed
        feed(s, batch, [3] * batch.batch_size)
    assert len(a.output_ids) == 12 and len(b.output_ids) == 12 and s.is_idle()
