"""The host KV tier's page pool on a GPU: pinned host pages, copies on a side stream that complete
with the returned event, pages exact after the round trip."""

import pytest
import torch

from pdserve.common.engine.host_kv_pool import HostKVPool
from pdserve.common.engine.kv_pool import PagedKVPool


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_pages_round_trip_on_a_side_stream(dtype):
    pool = PagedKVPool(64, 16, 4, 8, 64, dtype, "cuda")
    for b in [*pool.k_storage, *pool.v_storage]:
        b.copy_(torch.randn(b.shape, device="cuda").to(dtype))
    host = HostKVPool(32, pool)
    assert host.pages.is_pinned() and host._direct(pool)  # one kernel on the mapped host pages
    source, slots = [5, 6, 7, 40, 2], [10, 11, 12, 3, 30]
    views = [b.view(torch.uint8).view(64, 16, 8, 64 * b.element_size()) for b in [*pool.k_storage, *pool.v_storage]]
    before = [v[source].clone() for v in views]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())  # the pages were written on the current stream
    stored = host.store(pool, source, slots, stream=side)
    stored.synchronize()
    for v in views:
        v[source] = 0
    target = [50, 51, 52, 53, 54]
    side.wait_stream(torch.cuda.current_stream())
    loaded = host.load(pool, slots, target, stream=side)
    torch.cuda.current_stream().wait_event(loaded)
    for v, b in zip(views, before):
        assert torch.equal(v[target], b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_write_through_pages_come_back_bitwise_after_evictions_without_a_copy(dtype):
    """The backup is stored on the store stream (held back here by a sleep queued on it first): the
    eviction copies nothing, the freed pages are rewritten at once on the current stream (which
    must wait for the store on the device), and the pages loaded back are the bytes cached."""
    from pdserve.common.scheduling.radix_cache import RadixCache

    pool = PagedKVPool(64, 16, 4, 8, 64, dtype, "cuda")
    host = HostKVPool(32, pool)  # write-through
    tree = RadixCache(pool, host)
    views = [b.view(torch.uint8).view(64, 16, 8, 64 * b.element_size()) for b in [*pool.k_storage, *pool.v_storage]]
    tokens = list(range(1000, 1000 + 5 * 16))
    pages = pool.alloc_pages(5)
    for b in [*pool.k_storage, *pool.v_storage]:  # the "forward" writing the KV, on the current stream
        b.copy_(torch.randn(b.shape, device="cuda").to(dtype))
    cached = [v[pages].clone() for v in views]
    with torch.cuda.stream(host.store_stream):
        torch.cuda._sleep(1_000_000_000)  # (the store starts ~0.5 s late)
    tree.insert(tokens, pages)
    assert tree.stats["host_backup_pages"] == 5 and host.stats["store_bytes"] == 0  # (still running)
    for _ in range(2):  # evicted, loaded back, evicted again: the one store serves both
        assert tree.evict(5) == 5 and tree.stats["host_stored_pages"] == 5
        for v in views:  # the next owner writes the freed pages at once
            v[pages] = 0
        _, node = tree.match_prefix(tokens)
        tree.inc_lock_ref(node)
        pages, node = tree.load_continuation(tokens, node, max_pages=8)
        host.wait_for(tree.pending_load(node))  # (None if already complete)
        for v, b in zip(views, cached):
            assert torch.equal(v[pages], b)
        tree.dec_lock_ref(node)
    assert tree.stats["host_evicted_without_copy_pages"] == 10
    tree.reset()
    torch.cuda.synchronize()
    assert host.num_free() == 32 and pool.num_free_pages() == pool.capacity_pages


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_host_tier_turns_on_cuda_equal_transformers_and_leave_nothing_behind(tiny_models, policy):
    """Multi-turn conversations through a device pool too small to keep them: the history goes to
    pinned host pages and comes back for the next turn, and the answers stay transformers'."""
    from pdserve.common.engine.engine import Engine
    from pdserve.common.types import SamplingParams
    from tests.test_disagg_engines import hf_greedy
    from tests.test_prefix_transfers import MAX_NEW, PAGE, conversations, next_turns

    path = tiny_models("llama")
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0)
    kw = dict(model_path=path, device="cuda", dtype="float32", max_total_tokens=32 * PAGE, context_length=256)
    for overlap in (True, False):
        tier = dict(host_kv_cache_gb=0.01, host_kv_write_policy=policy)
        engine = Engine(page_size=PAGE, disable_overlap_schedule=not overlap, **tier, **kw)
        tree = engine.scheduler.kv.tree_cache
        prompts = conversations(12, seed=7)
        for turn in range(3):
            outputs = [c.output_ids for c in engine.generate(prompts, params)]
            assert outputs == hf_greedy(path, prompts, MAX_NEW, device="cuda")
            assert engine.is_idle() and engine.stats()["kv_used_tokens"] == 0
            prompts = next_turns(prompts, outputs, seed=turn + 50)
        assert tree.stats["host_stored_pages"] > 0 and tree.stats["host_loaded_pages"] > 0
        through = tree.stats["host_evicted_without_copy_pages"] > 0 and tree.stats["host_backup_pages"] > 0
        assert through == (policy == "write_through")
