"""Features with tensor parallelism on two GPUs (NCCL, CUDA graphs): speculative decoding (n-gram with
drafts accepted and rejected at every position, and a draft model) and the host KV tier give transformers'
fp32 greedy tokens at tp = 2; FP8 weights and the FP8 KV cache in bf16 agree with the unquantized model as
tp = 1 does (the CPU versions: tests/test_tp_speculative.py, test_tp_host_kv.py, test_tp_fp8.py)."""

from types import SimpleNamespace

import pytest
import torch

from pdserve.bench.teacher_forced import score
from pdserve.common.types import SamplingParams
from tests.test_disagg_engines import hf_greedy
from tests.test_fp8_weights import PLAN, teacher_forced
from tests.test_host_kv_tier import POOL, check_host_accounting
from tests.test_prefix_transfers import MAX_NEW, conversations, next_turns
from tests.test_speculative_draft import other_draft  # noqa: F401 - a fixture
from tests.test_speculative_engine import PROMPTS, Oracle, assert_speculated, spec_stats
from tests.test_tp import engines_ending_idle

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
TP2 = dict(device="cuda", tp_size=2, max_total_tokens=16384, page_size=4, chunked_prefill_size=16)
GREEDY = SamplingParams(max_new_tokens=24, temperature=0)


@pytest.fixture
def engines():
    yield from engines_ending_idle({})


@pytest.mark.parametrize("overlap", [True, False])
def test_ngram_and_oracle_drafts_at_tp2_give_transformers_tokens(tiny_models, engines, overlap):
    path = tiny_models("llama")
    expected = hf_greedy(path, PROMPTS, 24, device="cuda")
    engine = engines(
        path,
        dtype="float32",
        speculative="ngram",
        speculative_overlap="on",
        disable_overlap_schedule=not overlap,
        **TP2,
    )
    assert engine.runner.cuda_graphs is not None
    assert [c.output_ids for c in engine.generate(PROMPTS, GREEDY)] == expected
    engine.scheduler.speculation.proposer = Oracle(PROMPTS, [SimpleNamespace(output_ids=e) for e in expected])
    assert [c.output_ids for c in engine.generate(PROMPTS, GREEDY)] == expected
    assert_speculated(engine)
    assert (spec_stats(engine)["spec_overlapped_steps"] > 0) == overlap


def test_a_draft_model_at_tp2_gives_transformers_tokens(tiny_models, other_draft, engines):  # noqa: F811
    path = tiny_models("llama")
    engine = engines(path, dtype="float32", speculative="draft", draft_model_path=other_draft("llama"), **TP2)
    assert [c.output_ids for c in engine.generate(PROMPTS, GREEDY)] == hf_greedy(path, PROMPTS, 24, device="cuda")
    assert_speculated(engine)


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_the_host_tier_at_tp2_gives_transformers_tokens(tiny_models, engines, policy):
    path = tiny_models("llama")
    probe = engines(path, device="cuda", dtype="float32", **POOL)
    gb = 64 * probe.runner.kv_pool.bytes_per_token() * POOL["page_size"] / 2 / (1 << 30)  # each rank: half the heads
    engine = engines(
        path, device="cuda", dtype="float32", tp_size=2, host_kv_cache_gb=gb, host_kv_write_policy=policy, **POOL
    )
    tree = engine.scheduler.kv.tree_cache
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0)
    prompts = conversations(12, seed=5)
    for turn in range(3):
        outputs = [c.output_ids for c in engine.generate(prompts, params)]
        assert outputs == hf_greedy(path, prompts, MAX_NEW, device="cuda"), turn
        check_host_accounting(tree)
        prompts = next_turns(prompts, outputs, seed=turn + 20)
    assert tree.stats["host_stored_pages"] > 0 and tree.stats["host_loaded_pages"] > 0


def test_fp8_weights_and_kv_at_tp2_agree_like_tp1(tiny_models, engines):
    """bf16 (the FP8 GEMMs' dtype), the Triton FP8 GEMM and the fused FP8 MLP inside CUDA graphs at tp = 2."""
    path = tiny_models("llama")
    base = teacher_forced(engines(path, device="cuda", dtype="bfloat16", max_total_tokens=16384))
    fp8 = dict(device="cuda", dtype="bfloat16", quantization="fp8", kv_cache_dtype="fp8_e4m3", max_total_tokens=16384)
    tp1 = score(PLAN, teacher_forced(engines(path, **fp8)), base)
    engine = engines(path, tp_size=2, **fp8)
    tp2 = score(PLAN, teacher_forced(engine), base)
    print(f"\nFP8 top-1 agreement with bf16: tp 1 {tp1['agreement']:.2%}, tp 2 {tp2['agreement']:.2%}")
    assert tp2["agreement"] >= tp1["agreement"] - 0.05
    got = engine.generate(PROMPTS, GREEDY)
    assert all(len(c.output_ids) > 0 for c in got) and engine.runner.cuda_graphs.replays > 0
