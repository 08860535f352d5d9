"""Exact tests of the radix prefix cache, and a randomized run through the real scheduler."""

import random

import pytest
import torch

from pdserve.common.engine.kv_pool import PagedKVPool
from pdserve.common.scheduling.radix_cache import RadixCache


def make_cache(num_pages=16, page_size=2):
    kv = PagedKVPool(num_pages, page_size, num_layers=1, kv_heads=1, head_dim=1, dtype=torch.float32, device="cpu")
    return RadixCache(kv), kv


def cache_pages(cache, kv, tokens):
    """What a finished request does: take pages, insert, free duplicates."""
    pages = kv.alloc_pages(len(tokens) // cache.page_size)
    already = cache.insert(tokens, pages)
    kv.free_pages(pages[:already])
    return pages


def test_match_on_empty_cache():
    cache, _ = make_cache()
    pages, node = cache.match_prefix([1, 2, 3, 4])
    assert pages == [] and node is cache.root


def test_insert_then_match_is_page_aligned():
    cache, kv = make_cache()
    assert cache.insert([1, 2, 3, 4, 5, 6], [7, 8, 9]) == 0
    assert cache.match_prefix([1, 2, 3, 4, 5, 6, 7])[0] == [7, 8, 9]
    assert cache.match_prefix([1, 2, 3, 4, 5])[0] == [7, 8]  # 5 tokens: 2 whole pages
    assert cache.match_prefix([1, 2, 3, 9])[0] == [7]  # diverges inside the second page
    assert cache.match_prefix([2, 1])[0] == []
    assert cache.evictable_pages == 3 and cache.total_pages() == 3


def test_match_inside_a_node_splits_it():
    cache, _ = make_cache()
    cache.insert([1, 2, 3, 4, 5, 6], [7, 8, 9])
    pages, node = cache.match_prefix([1, 2, 3, 4, 0, 0])
    assert pages == [7, 8] and node.key == (1, 2, 3, 4) and node.pages == [7, 8]
    [child] = node.children.values()
    assert child.key == (5, 6) and child.pages == [9] and child.parent is node
    assert cache.total_pages() == 3 and cache.evictable_pages == 3


def test_insert_reports_pages_already_cached_and_branches():
    cache, _ = make_cache()
    cache.insert([1, 2, 3, 4], [7, 8])
    assert cache.insert([1, 2, 3, 4, 5, 6], [10, 11, 12]) == 2  # 10, 11 are duplicates to free
    assert cache.insert([1, 2, 9, 9], [13, 14]) == 1  # branches after the first page
    assert cache.match_prefix([1, 2, 3, 4, 5, 6])[0] == [7, 8, 12]
    assert cache.match_prefix([1, 2, 9, 9])[0] == [7, 14]
    assert cache.insert([1, 2, 3, 4], [15, 16]) == 2
    assert cache.total_pages() == 4


def test_lock_ref_protects_the_whole_path():
    cache, _ = make_cache()
    cache.insert([1, 2, 3, 4, 5, 6], [7, 8, 9])
    cache.insert([1, 2, 3, 4, 0, 0], [7, 8, 10])
    _, node = cache.match_prefix([1, 2, 3, 4, 5, 6])
    cache.inc_lock_ref(node)
    assert cache.protected_pages == 3 and cache.evictable_pages == 1  # [7, 8] and [9]; [10] free
    cache.inc_lock_ref(node)
    cache.dec_lock_ref(node)
    assert cache.protected_pages == 3
    cache.dec_lock_ref(node)
    assert cache.protected_pages == 0 and cache.evictable_pages == 4


def test_evict_takes_unlocked_leaves_lru_first_and_then_their_parents():
    cache, kv = make_cache()
    a = cache_pages(cache, kv, [1, 2, 3, 4])  # pages 1, 2
    b = cache_pages(cache, kv, [1, 2, 5, 6])  # page 3 duplicate of 1 freed; 4 kept
    c = cache_pages(cache, kv, [9, 9])  # 5
    assert (a, b, c) == ([1, 2], [3, 4], [5])
    cache.match_prefix([1, 2, 5, 6])  # touch b's branch: a's leaf [2] is now the oldest
    free_before = kv.num_free_pages()
    assert cache.evict(1) == 1 and kv.num_free_pages() == free_before + 1
    assert cache.match_prefix([1, 2, 3, 4])[0] == [1]  # lost its second page
    assert cache.match_prefix([9, 9])[0] == [5]
    # with c locked, evicting everything leaves only c
    _, node = cache.match_prefix([9, 9])
    cache.inc_lock_ref(node)
    assert cache.evict(100) == 2  # page 4, then the parent [1]
    assert cache.total_pages() == 1 and cache.evictable_pages == 0 and cache.protected_pages == 1
    cache.dec_lock_ref(node)
    cache.reset()
    assert kv.num_free_pages() == kv.capacity_pages


def test_cached_prefix_len_does_not_touch_the_tree():
    cache, _ = make_cache()
    cache.insert([1, 2, 3, 4, 5, 6], [7, 8, 9])
    assert cache.cached_prefix_len([1, 2, 3, 4, 0]) == 4
    assert cache.cached_prefix_len([1, 2, 3, 4, 5, 6, 7, 8]) == 6
    [node] = cache.root.children.values()
    assert node.key == (1, 2, 3, 4, 5, 6)  # not split


def check_consistent(scheduler):
    """Every page is in exactly one place: the free list, the tree, or one live request's own pages;
    the tree's evictable/protected counts match a recount; lock refs match the live requests."""
    cache, kv = scheduler.tree_cache, scheduler.kv_pool
    free = list(kv._free_pages)
    tree = [p for n in cache._nodes() for p in n.pages]
    live = [r for r in list(scheduler.running) + list(scheduler.waiting) + [scheduler.chunked_req] if r is not None]
    owned = [p for r in live for p in r.pages[r.prefix_pages :]]
    everything = free + tree + owned
    assert sorted(everything) == list(range(1, kv.num_pages)), "a page is lost or held twice"
    locked = sum(len(n.pages) for n in cache._nodes() if n.lock_ref > 0 and n is not cache.root)
    assert locked == cache.protected_pages
    assert len(tree) - locked == cache.evictable_pages
    expected_refs = {}
    for r in live:
        node = r.last_node
        while node is not None and node is not cache.root:
            expected_refs[id(node)] = expected_refs.get(id(node), 0) + 1
            node = node.parent
    for n in cache._nodes():
        if n is not cache.root:
            assert n.lock_ref == expected_refs.get(id(n), 0)
            for child_first, child in n.children.items():
                assert child.parent is n and child.key[: cache.page_size] == child_first


def test_randomized_requests_with_aborts_end_with_every_page_free():
    from pdserve.common.types import Req, SamplingParams
    from tests.test_scheduler import feed, make_scheduler

    rng = random.Random(0)
    s = make_scheduler(
        num_pages=20, page_size=2, rows=6, context=36, max_running=6, max_prefill=12, chunk=5, radix=True, reserve=1
    )
    prefixes = [[rng.randrange(1, 50) for _ in range(rng.randrange(2, 10))] for _ in range(4)]
    live = []
    for i in range(300):
        if rng.random() < 0.4 and len(live) < 12:
            prompt = rng.choice(prefixes) + [rng.randrange(1, 50) for _ in range(rng.randrange(1, 8))]
            r = Req(f"r{i}", prompt, SamplingParams(max_new_tokens=rng.randrange(1, 16)), seed=0)
            s.add_request(r)
            live.append(r.rid)
        if rng.random() < 0.1 and live:
            s.abort(live.pop(rng.randrange(len(live))))
        batch = s.get_next_batch_to_run()
        if batch is not None:
            for done in feed(s, batch, [rng.randrange(1, 50) for _ in batch.reqs]):
                live.remove(done.rid)
        check_consistent(s)
    while s.has_work():
        batch = s.get_next_batch_to_run()
        feed(s, batch, [7] * batch.batch_size)
        check_consistent(s)
    assert s.is_idle()
    assert s.stats["cache_hit_tokens"] > 0 and s.stats["prefill_chunks"] > 0 and s.stats["retractions"] > 0
    s.tree_cache.reset()
    assert s.kv_pool.num_free_pages() == s.kv_pool.capacity_pages and s.tree_cache.total_pages() == 0


def test_eviction_heap_always_takes_the_least_recently_used_unlocked_leaf():
    """Random inserts, matches, locks, unlocks and evictions: each evicted leaf is, by brute force
    over the whole tree, an unlocked leaf with the oldest access, and every page is accounted for."""
    rng = random.Random(11)
    cache, kv = make_cache(num_pages=400, page_size=2)
    locked = []
    for _ in range(600):
        op = rng.random()
        tokens = [rng.randrange(3) for _ in range(2 * rng.randrange(1, 6))]  # few symbols: shared prefixes
        if op < 0.35 and kv.num_free_pages() >= 6:
            cache_pages(cache, kv, tokens)
        elif op < 0.55:
            _, node = cache.match_prefix(tokens)
            if node is not cache.root and rng.random() < 0.5:
                cache.inc_lock_ref(node)
                locked.append(node)
        elif op < 0.7 and locked:
            cache.dec_lock_ref(locked.pop(rng.randrange(len(locked))))
        else:
            leaves = [n for n in cache._nodes() if n is not cache.root and not n.children and n.lock_ref == 0]
            before = {id(n): n for n in leaves}
            oldest = min((n.last_access for n in leaves), default=None)
            freed = cache.evict(1)
            gone = [n for i, n in before.items() if n.parent is None]
            if oldest is None:
                assert freed == 0 and not gone
            else:
                assert len(gone) == 1 and gone[0].last_access == oldest and freed == len(gone[0].pages)
        held = sum(len(n.pages) for n in cache._nodes())
        assert held == cache.evictable_pages + cache.protected_pages
        assert kv.num_free_pages() + held == kv.capacity_pages
    for node in locked:
        cache.dec_lock_ref(node)
    cache.reset()
    assert cache.total_pages() == 0 and kv.num_free_pages() == kv.capacity_pages


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_randomized_host_tier_keeps_every_page_and_slot_accounted_for(policy):
    """Random inserts, matches, loads back from the host tier, locks, unlocks and evictions over a
    device pool and a smaller host pool: every device page and host slot is in exactly one place
    after each step, and all are free after the last unlock and a reset."""
    from pdserve.common.engine.host_kv_pool import HostKVPool
    from tests.test_host_kv_tier import check_host_accounting

    rng = random.Random(5)
    kv = PagedKVPool(24, 2, num_layers=1, kv_heads=1, head_dim=1, dtype=torch.float32, device="cpu")
    cache = RadixCache(kv, HostKVPool(10, kv, write_policy=policy))
    locked = []
    for _ in range(800):
        op = rng.random()
        tokens = [rng.randrange(3) for _ in range(2 * rng.randrange(1, 6))]
        if op < 0.3:
            if kv.num_free_pages() < 5:
                cache.evict(5 - kv.num_free_pages())
            if kv.num_free_pages() >= 5:
                cache_pages(cache, kv, tokens)
        elif op < 0.6:
            pages, node = cache.match_prefix(tokens)
            cache.inc_lock_ref(node)
            more, node = cache.load_continuation(tokens, node, cache.evictable_pages + kv.num_free_pages())
            assert cache.match_prefix(tokens)[0] == pages + more
            locked.append(node)
        elif op < 0.8 and locked:
            cache.dec_lock_ref(locked.pop(rng.randrange(len(locked))))
        else:
            cache.evict(rng.randrange(1, 4))
        held = sum(len(n.pages) for n in cache._nodes())
        assert held == cache.evictable_pages + cache.protected_pages
        assert kv.num_free_pages() + held == kv.capacity_pages
        check_host_accounting(cache)
    assert cache.stats["host_loaded_pages"] > 0 and cache.stats["host_dropped_pages"] > 0
    assert (cache.stats["host_evicted_without_copy_pages"] > 0) == (policy == "write_through")
    for node in locked:
        cache.dec_lock_ref(node)
    cache.reset()
    assert cache.total_pages() == 0 and kv.num_free_pages() == kv.capacity_pages
    assert cache.host_pages == 0 and cache.host.num_free() == cache.host.num_pages and cache.num_nodes == 1
