"""The prefix cache's host tier (`--host-kv-cache-gb`, common/scheduling/radix_cache.py): pages
evicted from a small device pool are kept in host memory and copied back on a hit; answers stay
transformers', nothing leaks on either side, and the host pool's slots are all accounted for.
Both write policies (`--host-kv-write-policy`): write_through backs pages up as they are cached
and evicts them without a copy; write_back copies them when evicted."""

import pytest
import torch

from pdserve.common.engine.engine import Engine
from pdserve.common.engine.host_kv_pool import HostKVPool
from pdserve.common.scheduling.radix_cache import RadixCache
from pdserve.common.types import SamplingParams
from tests.test_disagg_engines import drive, engines, hf_greedy
from tests.test_host_kv_pool import device_pool, page_of
from tests.test_prefix_transfers import MAX_NEW, PAGE, conversations, next_turns

POOL = dict(max_total_tokens=32 * PAGE, context_length=256, page_size=PAGE)


def host_gb(path, pages: int) -> float:
    probe = Engine(model_path=path, device="cpu", **POOL)
    page_bytes = probe.runner.kv_pool.bytes_per_token() * PAGE
    return pages * page_bytes / (1 << 30)


def check_host_accounting(tree) -> None:
    slots = [s for n in tree._nodes() if n.host is not None for s in n.host]
    assert len(slots) == tree.host_pages == tree.host.num_pages - tree.host.num_free()
    assert len(set(slots)) == len(slots) and set(slots).isdisjoint(tree.host._free)  # each slot held once
    for n in tree._nodes():
        if n.pages and n.host is not None:  # a backup: write-through only, a slot per page
            assert tree.host.write_through and len(n.host) == len(n.pages)
        if n is not tree.root and not n.pages:  # host-only: held in slots, only host-only descendants
            assert n.host is not None and all(not c.pages for c in n.children.values())


def check_policy_stats(tree, policy: str) -> None:
    """Which path the copies took: write-through backs pages up when cached and evicts them without
    a copy; write-back copies each page when it is evicted."""
    stats = tree.stats
    if policy == "write_through":
        assert stats["host_backup_pages"] > 0 and stats["host_evicted_without_copy_pages"] > 0
    else:
        assert stats["host_backup_pages"] == 0 == stats["host_evicted_without_copy_pages"]
    assert stats["host_stored_pages"] >= stats["host_backup_pages"]


POLICIES = ["write_through", "write_back"]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("overlap", [True, False])
def test_colocated_turns_reload_their_history_from_host_memory(tiny_models, overlap, policy):
    path = tiny_models("llama")
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0)
    tier = dict(host_kv_cache_gb=host_gb(path, 64), host_kv_write_policy=policy)
    engine = Engine(model_path=path, device="cpu", disable_overlap_schedule=not overlap, **tier, **POOL)
    tree = engine.scheduler.kv.tree_cache
    prompts = conversations(12, seed=5)
    for turn in range(3):
        expected = hf_greedy(path, prompts, MAX_NEW)
        outputs = [c.output_ids for c in engine.generate(prompts, params)]
        assert outputs == expected
        assert engine.is_idle() and engine.stats()["kv_used_tokens"] == 0
        check_host_accounting(tree)
        prompts = next_turns(prompts, outputs, seed=turn + 20)
    assert tree.stats["host_stored_pages"] > 0 and tree.stats["host_loaded_pages"] > 0
    check_policy_stats(tree, policy)


@pytest.mark.parametrize("policy", POLICIES)
def test_a_decode_server_reloads_a_conversation_and_is_sent_only_the_rest(tiny_models, policy):
    path = tiny_models("llama")
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0)
    tier = dict(host_kv_cache_gb=host_gb(path, 64), host_kv_write_policy=policy)
    prefill, decode = engines(path, decode_kw=POOL | tier)
    tree = decode.scheduler.kv.tree_cache
    prompts = conversations(12, seed=6)
    for turn in range(3):
        expected = hf_greedy(path, prompts, MAX_NEW)
        completions, _ = drive(prefill, decode, prompts, [params] * len(prompts), seed=turn)
        outputs = [completions[f"r{i}"].output_ids for i in range(len(prompts))]
        assert outputs == expected
        assert prefill.is_idle() and decode.is_idle() and decode.stats()["kv_used_tokens"] == 0
        check_host_accounting(tree)
        prompts = next_turns(prompts, outputs, seed=turn + 30)
    assert tree.stats["host_loaded_pages"] > 0
    assert decode.scheduler.stats["transfer_prefix_hit_tokens"] > 0
    check_policy_stats(tree, policy)


@pytest.mark.parametrize("policy", POLICIES)
def test_a_full_host_pool_drops_its_least_recently_used_pages(tiny_models, policy):
    """A host pool of 4 pages under a stream of distinct prompts: it stays full, drops what it
    must, and answers stay exact."""
    path = tiny_models("llama")
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0)
    tier = dict(host_kv_cache_gb=host_gb(path, 4), host_kv_write_policy=policy)
    engine = Engine(model_path=path, device="cpu", **tier, **POOL)
    tree = engine.scheduler.kv.tree_cache
    for seed in range(4):
        prompts = conversations(6, seed=40 + seed)
        assert [c.output_ids for c in engine.generate(prompts, params)] == hf_greedy(path, prompts, MAX_NEW)
        check_host_accounting(tree)
        assert engine.is_idle() and engine.stats()["kv_used_tokens"] == 0
    assert tree.stats["host_dropped_pages"] > 0 and tree.host.num_free() <= 4
    tree.reset()  # every page back, on the device and in host memory
    assert tree.host_pages == 0 and tree.host.num_free() == tree.host.num_pages
    assert engine.runner.kv_pool.num_free_pages() == engine.runner.kv_pool.capacity_pages


def test_the_host_tier_is_refused_where_it_cannot_work(tiny_models):
    """It backs the prefix cache, so it needs one (with TP: tests/test_tp_host_kv.py)."""
    from pdserve.common.config import EngineConfig

    path = tiny_models("llama")
    for bad in (dict(disable_radix_cache=True), dict(host_kv_cache_gb=-1.0)):
        with pytest.raises(ValueError, match="host-kv-cache-gb"):
            EngineConfig(model_path=path, device="cpu", **(dict(host_kv_cache_gb=1.0) | bad)).resolve()
    with pytest.raises(ValueError, match="host-kv-write-policy"):
        Engine(model_path=path, device="cpu", host_kv_cache_gb=host_gb(path, 4), host_kv_write_policy="later", **POOL)


class CountingHost(HostKVPool):
    """A host pool that counts its device -> host copies (pages per copy)."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.copies: list[int] = []

    def store(self, device, device_pages, slots, stream=None):
        self.copies.append(len(slots))
        return super().store(device, device_pages, slots, stream)


def tree_with_host(policy: str, host_pages: int = 8):
    pool = device_pool(num_pages=12, page=4)
    return RadixCache(pool, CountingHost(host_pages, pool, write_policy=policy)), pool


def clobber(pool, pages) -> None:
    """The device pages go to someone else, who writes them."""
    for b in [*pool.k_storage, *pool.v_storage]:
        b.view(pool.kv_heads, pool.num_pages, pool.page_size, pool.head_dim)[:, pages] = -1


def reload(tree, tokens) -> list[int]:
    got, node = tree.match_prefix(tokens)
    tree.inc_lock_ref(node)
    loaded, node = tree.load_continuation(tokens, node, max_pages=16)
    tree.dec_lock_ref(node)
    return got + loaded


@pytest.mark.parametrize("policy", POLICIES)
def test_write_through_copies_when_caching_and_never_when_evicting(policy):
    tree, pool = tree_with_host(policy)
    tokens = list(range(100, 116))  # 4 pages
    pages = pool.alloc_pages(4)
    originals = [page_of(pool, p).clone() for p in pages]
    tree.insert(tokens, pages)
    through = policy == "write_through"
    assert tree.host.copies == ([4] if through else []) and tree.host_pages == (4 if through else 0)
    for turn in range(3):  # evicted, reloaded, evicted again: the one copy made at insert serves each time
        assert tree.evict(4) == 4 and pool.num_free_pages() == pool.capacity_pages
        clobber(pool, pages)
        assert tree.host.copies == ([4] if through else [4] * (turn + 1))
        check_host_accounting(tree)
        pages = reload(tree, tokens)
        assert len(pages) == 4 and all(torch.equal(page_of(pool, p), o) for p, o in zip(pages, originals))
        assert tree.host_pages == (4 if through else 0)  # a loaded node keeps its slots as its backup
        check_host_accounting(tree)
    assert tree.stats["host_evicted_without_copy_pages"] == (12 if through else 0)
    assert tree.stats["host_stored_pages"] == (4 if through else 12) == sum(tree.host.copies)
    tree.reset()
    assert tree.host.num_free() == 8 and pool.num_free_pages() == pool.capacity_pages


def test_a_split_backup_keeps_each_half_with_its_own_slots():
    tree, pool = tree_with_host("write_through")
    tokens = list(range(100, 116))
    pages = pool.alloc_pages(4)
    originals = {p: page_of(pool, p).clone() for p in pages}
    tree.insert(tokens, pages)
    [node] = tree.root.children.values()
    slots = list(node.host)
    got, upper = tree.match_prefix(tokens[:8] + [0, 0, 0, 0])  # splits after 2 pages
    assert got == pages[:2] and upper.host == slots[:2] and upper.children[tuple(tokens[8:12])].host == slots[2:]
    check_host_accounting(tree)
    assert tree.evict(4) == 4 and tree.host.copies == [4]  # both halves host-only, no copy
    clobber(pool, pages)
    first = reload(tree, tokens[:8] + [0] * 8)  # only the upper half comes back
    assert len(first) == 2 and all(torch.equal(page_of(pool, p), originals[q]) for p, q in zip(first, pages))
    rest = reload(tree, tokens)[2:]
    assert len(rest) == 2 and all(torch.equal(page_of(pool, p), originals[q]) for p, q in zip(rest, pages[2:]))
    check_host_accounting(tree)


def test_backups_never_push_out_other_backups_and_evictions_then_copy():
    """A host pool of 4 pages: the first 4 cached pages are backed up; the next ones are not (the
    first are still on the device: their backups stay), so evicting them copies, as write-back."""
    tree, pool = tree_with_host("write_through", host_pages=4)
    a, b = list(range(100, 116)), list(range(200, 208))
    tree.insert(a, pool.alloc_pages(4))
    tree.insert(b, pool.alloc_pages(2))
    assert tree.host.copies == [4] and tree.stats["host_backup_pages"] == 4
    tree.match_prefix(a)  # a is the most recently used: b is evicted first
    assert tree.evict(2) == 2 and tree.host.copies == [4]  # no room for b without dropping a's backup
    assert tuple(b[:4]) not in tree.root.children  # dropped, not kept in host memory
    assert tree.evict(4) == 4 and tree.host.copies == [4]  # a's backup: no copy
    check_host_accounting(tree)
    tree.insert(b, pool.alloc_pages(2))  # a is host-only now: dropped for b's backup
    assert tree.host.copies == [4, 2] and tree.stats["host_dropped_pages"] == 4
    check_host_accounting(tree)


def test_making_device_room_for_a_load_never_drops_the_pages_being_loaded():
    """Loading A back needs a device page that only evicting B gives, and storing B wants host
    room that only dropping A gives: A is spared (B is dropped), then loaded."""
    pool = device_pool(num_pages=5, page=4)  # 4 usable pages
    tree = RadixCache(pool, HostKVPool(2, pool, write_policy="write_back"))
    a, b = list(range(100, 108)), list(range(200, 216))
    a_pages = pool.alloc_pages(2)
    originals = [page_of(pool, p).clone() for p in a_pages]
    tree.insert(a, a_pages)
    assert tree.evict(2) == 2 and tree.host.num_free() == 0  # A is host-only, the host pool full
    tree.insert(b, pool.alloc_pages(4))  # the device pool full of B
    loaded = reload(tree, a)
    assert len(loaded) == 2 and all(torch.equal(page_of(pool, p), o) for p, o in zip(loaded, originals))
    assert tuple(b[:4]) not in tree.root.children and tree.stats["host_dropped_pages"] == 0
    check_host_accounting(tree)
