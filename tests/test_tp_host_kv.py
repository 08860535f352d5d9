"""The host KV tier with tensor parallelism on CPU (gloo, tp = 2): rank 0's radix cache decides what is
stored to and loaded from host memory; every rank copies its own heads (common/engine/host_kv_pool.py
`replay`). A small device pool evicts conversations' prefixes to the host tier; their next turns hit them
there, load them back into other device pages, and answer as transformers does."""

import pytest

from pdserve.common.engine.engine import Engine
from pdserve.common.types import SamplingParams
from tests.test_disagg_engines import hf_greedy
from tests.test_host_kv_tier import POOL, check_host_accounting, check_policy_stats, host_gb
from tests.test_prefix_transfers import MAX_NEW, conversations, next_turns


@pytest.mark.parametrize("policy, overlap", [("write_through", True), ("write_back", False)])
def test_prefixes_evicted_to_the_host_tier_and_hit_again_give_transformers_tokens(tiny_models, policy, overlap):
    path = tiny_models("llama")
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0)
    tier = dict(host_kv_cache_gb=host_gb(path, 64) / 2, host_kv_write_policy=policy)  # (each rank: half the heads)
    engine = Engine(model_path=path, device="cpu", tp_size=2, disable_overlap_schedule=not overlap, **tier, **POOL)
    try:
        tree = engine.scheduler.kv.tree_cache
        assert tree.host.num_pages == 64 and engine.runner.kv_pool.kv_heads == 1
        prompts = conversations(12, seed=5)
        for turn in range(3):
            outputs = [c.output_ids for c in engine.generate(prompts, params)]
            assert outputs == hf_greedy(path, prompts, MAX_NEW), turn
            assert engine.is_idle() and engine.stats()["kv_used_tokens"] == 0
            check_host_accounting(tree)
            prompts = next_turns(prompts, outputs, seed=turn + 20)
        assert tree.stats["host_stored_pages"] > 0 and tree.stats["host_loaded_pages"] > 0
        check_policy_stats(tree, policy)
    finally:
        procs = engine.tp_workers.procs
        engine.close()
    assert all(p.poll() is not None for p in procs), "a TP rank outlived its engine"
