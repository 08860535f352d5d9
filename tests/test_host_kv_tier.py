"""The prefix cache's host tier (`--host-kv-cache-gb`, common/scheduling/radix_cache.py): pages
evicted from a small device pool are kept in host memory and copied back on a hit; answers stay
transformers', nothing leaks on either side, and the host pool's slots are all accounted for."""

import pytest

from pdserve.common.engine.engine import Engine
from pdserve.common.types import SamplingParams
from tests.test_disagg_engines import drive, engines, hf_greedy
from tests.test_prefix_transfers import MAX_NEW, PAGE, conversations, next_turns

POOL = dict(max_total_tokens=32 * PAGE, context_length=256, page_size=PAGE)


def host_gb(path, pages: int) -> float:
    probe = Engine(model_path=path, device="cpu", **POOL)
    page_bytes = probe.runner.kv_pool.bytes_per_token() * PAGE
    return pages * page_bytes / (1 << 30)


def check_host_accounting(tree) -> None:
    held = sum(len(n.host) for n in tree._nodes() if n.host is not None)
    assert held == tree.host_pages == tree.host.num_pages - tree.host.num_free()
    assert all(not (n.pages and n.host) for n in tree._nodes())  # a node is on the device or the host
    for n in tree._nodes():  # a host-only node has only host-only descendants
        if n is not tree.root and not n.pages:
            assert all(not c.pages for c in n.children.values())


@pytest.mark.parametrize("overlap", [True, False])
def test_colocated_turns_reload_their_history_from_host_memory(tiny_models, overlap):
    path = tiny_models("llama")
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0)
    engine = Engine(
        model_path=path, device="cpu", disable_overlap_schedule=not overlap, host_kv_cache_gb=host_gb(path, 64), **POOL
    )
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


def test_a_decode_server_reloads_a_conversation_and_is_sent_only_the_rest(tiny_models):
    path = tiny_models("llama")
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0)
    prefill, decode = engines(path, decode_kw=POOL | dict(host_kv_cache_gb=host_gb(path, 64)))
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


def test_a_full_host_pool_drops_its_least_recently_used_pages(tiny_models):
    """A host pool of 4 pages under a stream of distinct prompts: it stays full, drops what it
    must, and answers stay exact."""
    path = tiny_models("llama")
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0)
    engine = Engine(model_path=path, device="cpu", host_kv_cache_gb=host_gb(path, 4), **POOL)
    tree = engine.scheduler.kv.tree_cache
    for seed in range(4):
        prompts = conversations(6, seed=40 + seed)
        assert [c.output_ids for c in engine.generate(prompts, params)] == hf_greedy(path, prompts, MAX_NEW)
        check_host_accounting(tree)
    assert tree.stats["host_dropped_pages"] > 0 and tree.host.num_free() <= 4


def test_the_host_tier_is_refused_where_it_cannot_work_yet(tiny_models):
    """It copies the scheduler's own pool: a TP server's other ranks would lose their pages; and it
    backs the prefix cache, so it needs one."""
    from pdserve.common.config import EngineConfig

    path = tiny_models("llama")
    for bad in (dict(tp_size=2), dict(disable_radix_cache=True), dict(host_kv_cache_gb=-1.0)):
        with pytest.raises(ValueError, match="host-kv-cache-gb"):
            EngineConfig(model_path=path, device="cpu", **(dict(host_kv_cache_gb=1.0) | bad)).resolve()
