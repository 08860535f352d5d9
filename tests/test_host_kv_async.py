"""Host-tier loads are asynchronous (`--host-kv-cache-gb`): a request whose cached prefix is being
copied back from host memory waits while the others run, no forward reads a page before its copy
completes, a second request matching through pages still loading waits for the same copy, and a
request freed mid-copy waits for it before its pages change hands. Write-through backups are
asynchronous too (the store stream): an evicted page is rewritten only after its store read it,
and a decode server publishes a KV destination (whose WRITE no stream of its own orders) only once
the stores still reading its pages have completed.

On the CPU the pool's copies are synchronous; here each load's and each store_async's copy is
deferred until its event has been polled a few times (DeferredCopy), so a forward that read early,
or a store that read a page after it changed hands, would make the answers differ from
transformers'."""

import time

import pytest
import torch

from pdserve.common.engine.engine import Engine
from pdserve.common.engine.host_kv_pool import HostKVPool
from pdserve.common.scheduling.radix_cache import RadixCache
from pdserve.common.types import SamplingParams
from tests.test_disagg_engines import drive, engines, hf_greedy
from tests.test_host_kv_pool import device_pool, page_of
from tests.test_host_kv_tier import POOL, check_host_accounting, host_gb
from tests.test_prefix_transfers import MAX_NEW, conversations, next_turns

POLLS = 3  # queries before a deferred copy runs and reports done (`deferred.polls`)


class DeferredCopy:
    """A CUDA event's stand-in whose copy runs only when it completes. Copies queue on one stream
    (the host pool's): one completes only after every copy issued before it."""

    def __init__(self, copy, polls: int, earlier: list):
        self.copy, self.left, self.synced, self.earlier = copy, polls, False, list(earlier)

    def query(self) -> bool:
        self.left -= 1
        if self.left < 0 and self.copy is not None:
            self._complete()
        return self.copy is None

    def synchronize(self) -> None:
        self.synced = True
        self._complete()

    def _complete(self) -> None:
        for event in [*self.earlier, self]:  # (in issue order)
            if event.copy is not None:
                event.copy()
                event.copy = None


class Deferrals(list):
    polls = POLLS


@pytest.fixture
def deferred(monkeypatch):
    """The loads' deferred copies (one stream); `deferred.stores`: the write-through stores' (another)."""
    made = Deferrals()
    made.stores = []

    def load_async(self, device, slots, pages, keep_slots=False):
        slots, pages = list(slots), list(pages)
        done = DeferredCopy(lambda: HostKVPool.load(self, device, slots, pages), made.polls, made)
        made.append(done)
        if not keep_slots:
            self.free_after(done, slots)
        return done

    def store_async(self, device, pages, slots):
        pages, slots = list(pages), list(slots)
        done = DeferredCopy(lambda: HostKVPool.store(self, device, pages, slots), made.polls, made.stores)
        done.pages = pages  # (the device pages it reads)
        made.stores.append(done)
        return done

    monkeypatch.setattr(HostKVPool, "load_async", load_async)
    monkeypatch.setattr(HostKVPool, "store_async", store_async)
    return made


def watch_batches(scheduler, seen: dict) -> None:
    """Fail if a batch holds a request whose prefix is still loading; count batches that ran
    while some request's load was pending."""
    inner = scheduler.get_next_batch_to_run

    def get():
        batch = inner()
        loading = list(scheduler.prefill.loading) + list(getattr(scheduler, "landed", []))
        seen["max_loading"] = max(seen.get("max_loading", 0), len(loading))
        if batch is not None:
            assert all(r.kv_load is None for r in batch.reqs), "a forward would read pages still being copied"
            seen["ran_beside_a_load"] = seen.get("ran_beside_a_load", 0) + bool(loading)
        return batch

    scheduler.get_next_batch_to_run = get


@pytest.mark.parametrize("overlap", [True, False])
def test_requests_wait_for_their_prefix_while_others_run(tiny_models, deferred, overlap):
    path = tiny_models("llama")
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0)
    engine = Engine(
        model_path=path, device="cpu", disable_overlap_schedule=not overlap, host_kv_cache_gb=host_gb(path, 64), **POOL
    )
    seen: dict = {}
    watch_batches(engine.scheduler, seen)
    tree = engine.scheduler.kv.tree_cache
    prompts = conversations(12, seed=8)
    for turn in range(3):
        outputs = [c.output_ids for c in engine.generate(prompts, params)]
        assert outputs == hf_greedy(path, prompts, MAX_NEW)
        assert engine.is_idle() and engine.stats()["kv_used_tokens"] == 0
        check_host_accounting(tree)
        prompts = next_turns(prompts, outputs, seed=turn + 60)
    assert deferred and tree.stats["host_loaded_pages"] > 0
    assert seen["max_loading"] > 0 and seen["ran_beside_a_load"] > 0
    assert any(store.synced for store in deferred.stores)  # an eviction waited for a store still running
    tree.host.poll()  # every copy completed: every host slot is accounted for again
    assert tree.host.num_free() + tree.host_pages == tree.host.num_pages


def test_a_request_aborted_mid_copy_waits_for_it_and_frees_everything(tiny_models, deferred):
    path = tiny_models("llama")
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0)
    engine = Engine(
        model_path=path, device="cpu", disable_overlap_schedule=True, host_kv_cache_gb=host_gb(path, 64), **POOL
    )
    prompts = conversations(12, seed=9)
    outputs = [c.output_ids for c in engine.generate(prompts, params)]
    prompts = next_turns(prompts, outputs, seed=70)
    for i, ids in enumerate(prompts):
        engine.add_request(ids, params, rid=f"t{i}")
    done = {}
    for _ in range(200):
        if engine.scheduler.prefill.loading:
            break
        done |= {c.rid: c for c in engine.step()}
    assert engine.scheduler.prefill.loading, "no request waited for a copy from the host tier"
    victim = engine.scheduler.prefill.loading[0]
    copy = victim.kv_load
    assert not copy.synced
    engine.abort(victim.rid)
    assert copy.synced and victim.req_pool_idx is None  # waited for, then freed
    while engine.busy():
        done |= {c.rid: c for c in engine.step()}
    expected = hf_greedy(path, prompts, MAX_NEW)
    for i in range(len(prompts)):
        if f"t{i}" != victim.rid:
            assert done[f"t{i}"].output_ids == expected[i]
    assert engine.is_idle() and engine.stats()["kv_used_tokens"] == 0
    check_host_accounting(engine.scheduler.kv.tree_cache)


def test_a_decode_server_holds_a_landed_request_until_its_prefix_is_back(tiny_models, deferred):
    path = tiny_models("llama")
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0)
    prefill, decode = engines(path, decode_kw=POOL | dict(host_kv_cache_gb=host_gb(path, 64)))
    deferred.polls = 40  # (the transfer takes a few steps: a copy outlasting it keeps the request landed)
    seen: dict = {}
    watch_batches(decode.scheduler, seen)
    landed = []
    prompts = conversations(12, seed=10)
    for turn in range(3):
        completions, _ = drive(
            prefill,
            decode,
            prompts,
            [params] * len(prompts),
            seed=turn,
            before_step=lambda _: landed.append(len(decode.scheduler.landed)),
        )
        outputs = [completions[f"r{i}"].output_ids for i in range(len(prompts))]
        assert outputs == hf_greedy(path, prompts, MAX_NEW)
        assert prefill.is_idle() and decode.is_idle() and decode.stats()["kv_used_tokens"] == 0
        check_host_accounting(decode.scheduler.kv.tree_cache)
        prompts = next_turns(prompts, outputs, seed=turn + 80)
    assert max(landed) > 0 and decode.scheduler.kv.tree_cache.stats["host_loaded_pages"] > 0
    report = decode.scheduler.kv.host_tier_report()
    assert report["hit_tokens"] > 0 and report["load_bytes"] > 0 and report["store_bytes"] > 0
    stats, page = decode.scheduler.kv.tree_cache.stats, decode.scheduler.kv.page_size
    assert report["backup_tokens"] == stats["host_backup_pages"] * page > 0
    assert report["evicted_without_copy_tokens"] == stats["host_evicted_without_copy_pages"] * page > 0


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_a_second_match_through_pages_still_loading_waits_for_the_same_copy(deferred, policy):
    pool = device_pool(num_pages=8, page=4)
    tree = RadixCache(pool, HostKVPool(8, pool, write_policy=policy))
    tokens = list(range(100, 116))  # 4 pages
    pages = pool.alloc_pages(4)
    originals = [page_of(pool, p).clone() for p in pages]
    tree.insert(tokens, pages)
    assert tree.evict(4) == 4 and tree.host_pages == 4  # all in host memory now
    got, node = tree.match_prefix(tokens)
    assert got == [] and node is tree.root
    loaded, node = tree.load_continuation(tokens, node, max_pages=8)
    assert len(loaded) == 4 and tree.pending_load(node) is deferred[0]
    # Another request's match now finds the pages on the device, but still loading.
    again, other = tree.match_prefix(tokens[:12])
    assert again == loaded[:3] and tree.pending_load(other) is deferred[0]
    assert tree.host.num_free() == 4  # the slots being read are not free yet
    while tree.pending_load(other) is not None:
        pass
    for p, original in zip(loaded, originals):
        assert torch.equal(page_of(pool, p), original)
    assert tree.host.num_free() == (4 if policy == "write_through" else 8)  # (write-through: kept as a backup)
    check_host_accounting(tree)


def test_an_evicted_page_is_rewritten_only_after_its_backup_read_it(deferred, monkeypatch):
    """Write-through: a backup still being stored when its pages are evicted is waited for before
    they change hands, and its host slots are reused only once it has completed."""
    deferred.polls = 40
    pool = device_pool(num_pages=12, page=4)
    tree = RadixCache(pool, HostKVPool(8, pool))
    tokens = list(range(100, 116))
    pages = pool.alloc_pages(4)
    originals = [page_of(pool, p).clone() for p in pages]
    tree.insert(tokens, pages)
    [store] = deferred.stores
    assert not store.synced and tree.host.num_free() == 4
    assert tree.evict(4) == 4 and store.synced  # (on a GPU: the current stream waits for its event)
    for b in [*pool.k_storage, *pool.v_storage]:  # the next owner writes the pages
        b.view(pool.kv_heads, pool.num_pages, pool.page_size, pool.head_dim)[:, pages] = 0
    got, node = tree.match_prefix(tokens)
    loaded, node = tree.load_continuation(tokens, node, max_pages=8)
    deferred[0].synchronize()
    tree.dec_lock_ref(node)
    for p, original in zip(loaded, originals):
        assert torch.equal(page_of(pool, p), original)
    # A backup dropped while its store runs: its slots stay taken until the store completes.
    other = list(range(200, 216))
    tree.insert(other, pool.alloc_pages(4))
    waits = []  # as on a GPU: the stream waits for the store, the host does not
    monkeypatch.setattr(HostKVPool, "wait_for", lambda self, done: waits.append(done))
    tree.reset()
    assert waits == [deferred.stores[1]] and tree.host_pages == 0 and tree.host.num_free() == 4
    deferred.stores[1].synchronize()
    assert tree.host.num_free() == 8


def test_the_host_tier_metrics_count_what_each_report_adds():
    from pdserve.common.serving import ipc
    from pdserve.common.serving.server_metrics import Metrics

    metrics = Metrics("decode")
    value = metrics.registry.get_sample_value
    report = dict(hit_tokens=64, load_bytes=4096, load_s=0.001, store_bytes=8192, store_s=0.0)
    report |= dict(backup_tokens=128, evicted_without_copy_tokens=32)
    metrics.update(ipc.LoadReport(1, 0, 10, 100, 0, host_tier=report))
    metrics.update(ipc.LoadReport(1, 0, 10, 100, 0, host_tier=report | dict(hit_tokens=96, load_bytes=6144)))
    assert value("pdserve_host_kv_hit_tokens_total", {"role": "decode"}) == 96
    assert value("pdserve_host_kv_copy_bytes_total", {"role": "decode", "direction": "load"}) == 6144
    assert value("pdserve_host_kv_copy_bytes_total", {"role": "decode", "direction": "store"}) == 8192
    assert value("pdserve_host_kv_copy_seconds_total", {"role": "decode", "direction": "load"}) == 0.001
    assert value("pdserve_host_kv_backup_tokens_total", {"role": "decode"}) == 128
    assert value("pdserve_host_kv_evicted_without_copy_tokens_total", {"role": "decode"}) == 32
    metrics.update(ipc.LoadReport(1, 0, 10, 100, 0))  # a server without a host tier reports none
    assert value("pdserve_host_kv_hit_tokens_total", {"role": "decode"}) == 96


class StreamWaits(list):
    """`HostKVPool.wait_for` as on a GPU: the scheduling stream, not the host, waits for the store.
    Here the stores it waited for complete before what that stream orders after them runs (the next
    forward; a load's copy), and before nothing else: a prefill server's WRITE into a KV destination
    is ordered by no stream of the decode server."""

    def __init__(self, monkeypatch, scheduler):
        super().__init__()
        monkeypatch.setattr(HostKVPool, "wait_for", lambda pool, done: done is not None and self.append(done))
        deferred_load = HostKVPool.load_async

        def load_async(pool, *args, **kwargs):  # (the load stream runs after what the scheduling stream waits for)
            done, waits = deferred_load(pool, *args, **kwargs), list(self)
            copy = done.copy
            done.copy = lambda: ([w.synchronize() for w in waits], copy())
            return done

        monkeypatch.setattr(HostKVPool, "load_async", load_async)
        inner = scheduler.get_next_batch_to_run

        def get():
            batch = inner()
            if batch is not None:
                self.sync()
            return batch

        scheduler.get_next_batch_to_run = get

    def sync(self) -> None:
        while self:
            self.pop().synchronize()


def held_destination(tiny_models, deferred, monkeypatch):
    """A decode server whose only cached prompt (prefilled there, its write-through backup still
    being stored) is evicted to admit a transfer: (prefill, decode, its loop, the cached prompt, the
    transferred prompt, the held request)."""
    path = tiny_models("llama")
    prefill, decode = engines(path, decode_kw=POOL | dict(host_kv_cache_gb=host_gb(path, 64)))
    deferred.polls = 10**9  # (a store completes only when the scheduling stream waited for it)
    StreamWaits(monkeypatch, decode.scheduler)
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0)
    cached = [0] + list(range(5, 5 + 20 * 8 - 1))
    decode.add_local_request(cached, params, rid="cached")
    loop = decode.event_loop()
    while decode.busy():
        next(loop)
    assert decode.scheduler.kv.tree_cache.stats["host_backup_pages"] >= 20
    assert not any(store.copy is None for store in deferred.stores)  # the backup is still being stored
    prompt = [0] + list(range(300, 300 + 20 * 8 - 1))  # nothing in common: 21 pages, 20 of them evicted
    decode.add_decode_request(prompt, params, room=7, rid="r0")
    next(loop)
    assert decode.scheduler.kv.tree_cache.stats["host_evicted_without_copy_pages"] > 0
    [req] = decode.scheduler.transferring.values()
    assert req.room in decode.scheduler.held and not decode.destinations, "published before its pages' store ran"
    for _ in range(5):
        next(loop)
        assert not decode.destinations and decode.scheduler.granted_pages(7) is None  # (held: not granted yet)
    return prefill, decode, loop, cached, prompt, req


def test_a_destination_is_published_only_once_the_stores_reading_its_pages_completed(
    tiny_models, deferred, monkeypatch
):
    """A decode server's eviction frees pages a write-through backup still reads: the destination
    granting them to a prefill server, whose WRITE no stream here orders, waits for the store."""
    prefill, decode, loop, cached, prompt, req = held_destination(tiny_models, deferred, monkeypatch)
    held_deadline = req.deadline
    for store in decode.scheduler.held[req.room]:
        store.synchronize()  # the store completes
    next(loop)
    [d] = decode.destinations
    assert d.rid == "r0" and not decode.scheduler.held and req.deadline > held_deadline  # its timeout starts now
    assert abs((d.expires_unix_s - time.time()) - (req.deadline - time.monotonic())) < 0.5
    decode.destinations.clear()
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0)
    prefill.add_prefill_request(
        prompt, params, d.room, d.agent_metadata, d.page_ids, rid="r0", expires_unix_s=d.expires_unix_s
    )
    p_loop, done = prefill.event_loop(), {}
    while decode.busy() or prefill.busy():
        next(p_loop)
        done |= {c.rid: c for c in next(loop)}
    # The evicted prompt again: its KV comes back from the host copy the WRITE did not overwrite.
    tree = decode.scheduler.kv.tree_cache
    loaded, deferred.polls = tree.stats["host_loaded_pages"], POLLS
    decode.add_local_request(cached, params, rid="again")
    while decode.busy():
        done |= {c.rid: c for c in next(loop)}
    assert tree.stats["host_loaded_pages"] > loaded
    assert [done[rid].output_ids for rid in ("r0", "again")] == hf_greedy(
        tiny_models("llama"), [prompt, cached], MAX_NEW
    )
    assert decode.is_idle() and decode.stats()["kv_used_tokens"] == 0


def test_a_held_destination_aborted_frees_its_pages_and_is_never_published(tiny_models, deferred, monkeypatch):
    prefill, decode, loop, _, _, req = held_destination(tiny_models, deferred, monkeypatch)
    completion = decode.abort("r0")
    assert completion is not None and completion.finish_reason.value == "abort"
    assert req.req_pool_idx is None and not decode.scheduler.transferring and not decode.scheduler.held
    for _ in range(3):
        next(loop)
    assert not decode.destinations and not decode.busy()
    assert decode.is_idle() and decode.stats()["kv_used_tokens"] == 0


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_an_eviction_lists_the_stores_still_reading_the_pages_it_frees(deferred, monkeypatch, policy):
    pool = device_pool(num_pages=8, page=4)
    tree = RadixCache(pool, HostKVPool(8, pool, write_policy=policy))
    monkeypatch.setattr(HostKVPool, "wait_for", lambda self, done: None)  # (on a GPU: a device-side wait)
    if policy == "write_back":  # (its store runs on the caller's stream: on a GPU, it returns an event)

        def store(self, *args):
            deferred.stores.append(object())
            return deferred.stores[-1]

        monkeypatch.setattr(HostKVPool, "store", store)
    pages = pool.alloc_pages(4)
    tree.insert(list(range(100, 116)), pages)
    assert tree.evict(4) == 4
    [store] = deferred.stores
    assert tree.unsettled == [(pages, store)]  # (a KV destination granting these pages waits for it)


def test_a_decode_server_publishes_no_destination_a_store_still_reads(tiny_models, deferred, monkeypatch):
    """Conversations through a decode server whose small pool evicts on most admissions: no KV
    destination is published while a write-through store still reads one of its pages (the prefill
    server's WRITE would overwrite them under it), and the answers stay transformers'."""
    path = tiny_models("llama")
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0)
    prefill, decode = engines(path, decode_kw=POOL | dict(host_kv_cache_gb=host_gb(path, 64)))
    deferred.polls = 40
    StreamWaits(monkeypatch, decode.scheduler)
    inner, seen = decode.pop_preallocated, {"held": 0, "published": 0}

    def pop_preallocated():
        before = len(decode.destinations)
        inner()
        seen["held"] = max(seen["held"], len(decode.scheduler.held))
        for d in list(decode.destinations)[before:]:
            reading = [s for s in deferred.stores if s.copy is not None and not set(s.pages).isdisjoint(d.page_ids)]
            assert not reading, f"{d.rid}'s destination was published while a store still read its pages"
            seen["published"] += 1

    decode.pop_preallocated = pop_preallocated
    prompts = conversations(12, seed=11)
    for turn in range(3):
        completions, _ = drive(prefill, decode, prompts, [params] * len(prompts), seed=turn)
        outputs = [completions[f"r{i}"].output_ids for i in range(len(prompts))]
        assert outputs == hf_greedy(path, prompts, MAX_NEW)
        assert prefill.is_idle() and decode.is_idle() and decode.stats()["kv_used_tokens"] == 0
        check_host_accounting(decode.scheduler.kv.tree_cache)
        prompts = next_turns(prompts, outputs, seed=turn + 90)
    assert seen["held"] > 0 and seen["published"] == 36
