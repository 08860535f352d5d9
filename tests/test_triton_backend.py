"""The Triton attention backend inside the engine, on CPU through Triton's interpreter.

The kernels themselves are checked against a float64 reference in test_triton_kernels.py; this
checks the backend's wiring (metadata, the KV store, decode vs extend, chunks over a cached prefix)
by greedy parity with transformers, the same contract the torch-native backend meets.
"""

from collections import Counter

import pytest

from pdserve.common.types import SamplingParams
from tests.test_disagg_engines import hf_greedy, make_prompts


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_triton_backend_greedy_matches_transformers(make_engine, tiny_models, arch):
    prompts = make_prompts(4, seed=7)
    # Five tokens: four decode steps, so every request's decode crosses a page (the interpreted
    # kernels cost ~0.3 s a step).
    expected = hf_greedy(tiny_models(arch), prompts, 5)
    # Page size 4 and 16-token chunks: extends over a cached prefix, page-crossing slots.
    engine = make_engine(arch, attention_backend="triton", page_size=4, chunked_prefill_size=16, max_total_tokens=4096)
    # Decode attention splits each request's keys in two (the interpreter's cap, against up to 16 on a
    # GPU): the split-K reduce runs.
    assert engine.runner.attn.kv_splits(len(prompts)) == 2
    params = SamplingParams(max_new_tokens=5, temperature=0)
    assert [c.output_ids for c in engine.generate(prompts, params)] == expected
    assert engine.scheduler.stats["prefill_chunks"] > 0
    # Second pass: prefix-cache hits, so extends start past a cached prefix.
    again = engine.generate(prompts, params)
    assert [c.output_ids for c in again] == expected
    assert sum(c.cached_tokens for c in again) > 0


@pytest.mark.parametrize("arch", ["qwen3", "mistral", "gpt2"])
def test_fused_model_path_greedy_matches_transformers(make_engine, tiny_models, arch, monkeypatch):
    """The CUDA fast path's model (merged projections, Triton RMSNorm / rotary / silu_mul /
    gelu kernels) with the Triton backend, through the interpreter: same greedy tokens.
    Llama-family layers rotate and store K/V in one launch (rope_store_kv), never store_kv."""
    from pdserve.common.engine.attention import triton_backend

    calls = Counter()

    def counted(name, kernel):
        def call(*args):
            calls[name] += 1
            return kernel(*args)

        return call

    for name in ("rope_store_kv", "store_kv"):
        monkeypatch.setattr(triton_backend, name, counted(name, getattr(triton_backend, name)))
    prompts = make_prompts(3, seed=8)
    expected = hf_greedy(tiny_models(arch), prompts, 6)
    engine = make_engine(arch, attention_backend="triton", page_size=4, max_total_tokens=4096)
    engine.runner.model.fuse()
    params = SamplingParams(max_new_tokens=6, temperature=0)
    assert [c.output_ids for c in engine.generate(prompts, params)] == expected
    if arch == "gpt2":  # no rotary: the plain store
        assert calls["rope_store_kv"] == 0 and calls["store_kv"] > 0
    else:
        assert calls["rope_store_kv"] > 0 and calls["store_kv"] == 0


def test_cuda_graph_capture_sizes_cover_every_batch_up_to_the_max():
    from pdserve.common.engine.cuda_graph import capture_sizes

    for max_bs in (1, 3, 8, 37, 128, 200, 256):
        sizes = capture_sizes(max_bs)
        assert sizes == sorted(set(sizes)) and sizes[-1] == max_bs and sizes[0] == 1
        # every batch size pads to a captured size at most 16 rows (or 2x, for tiny ones) larger
        for n in range(1, max_bs + 1):
            padded = next(s for s in sizes if s >= n)
            assert padded - n < max(16, n)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_padded_prefill_graph_forward_matches_transformers(make_engine, tiny_models, arch):
    """The prefill-graph runner's padded forward, run eagerly (capture needs a GPU): tokens padded
    up to the captured count and unused request slots, over chunks and cached prefixes, on the
    fused model path: the same greedy tokens as transformers."""
    from pdserve.common.engine.prefill_graph import PrefillGraphRunner

    prompts = make_prompts(5, seed=11)
    expected = hf_greedy(tiny_models(arch), prompts, 4)
    engine = make_engine(arch, attention_backend="triton", page_size=4, chunked_prefill_size=32, max_total_tokens=4096)
    engine.runner.model.fuse()
    graphs = PrefillGraphRunner(engine.runner, max_tokens=32, max_reqs=3, capture=False)
    engine.runner.prefill_graphs = graphs
    padded = []
    replay = graphs.replay
    graphs.replay = lambda batch: (padded.append((batch.num_tokens, batch.batch_size)), replay(batch))[1]
    params = SamplingParams(max_new_tokens=4, temperature=0)
    assert [c.output_ids for c in engine.generate(prompts, params)] == expected
    again = engine.generate(prompts, params)  # prefix hits: extends start past a cached prefix
    assert [c.output_ids for c in again] == expected
    assert sum(c.cached_tokens for c in again) > 0
    assert graphs.replays == len(padded) > 0
    assert any(n % 16 for n, _ in padded)  # token padding happened
    assert any(b < 3 for _, b in padded)  # unused request slots


def test_prefill_graph_sizes_pad_by_at_most_a_quarter():
    from pdserve.common.engine.prefill_graph import prefill_capture_sizes

    for max_tokens in (16, 48, 128, 992, 2048, 8192):
        sizes = prefill_capture_sizes(max_tokens)
        assert sizes == sorted(set(sizes)) and sizes[0] == 16 and sizes[-1] == max_tokens
        assert all(s % 16 == 0 for s in sizes)
        for n in range(1, max_tokens + 1):
            padded = next(s for s in sizes if s >= n)
            assert padded - n < max(16, n / 4 + 1)


def test_prefill_graphs_take_only_small_extend_batches(make_engine):
    """can_run: extend batches within the captured token count and request slots, with their
    upload rows; decode batches, bigger batches and batches without an upload run eagerly."""
    from pdserve.common.engine.prefill_graph import PrefillGraphRunner
    from pdserve.common.scheduling.batch import ForwardMode

    engine = make_engine("llama", attention_backend="triton", max_total_tokens=4096)
    graphs = PrefillGraphRunner(engine.runner, max_tokens=48, max_reqs=2, capture=False)
    assert graphs.sizes == [16, 32, 48]

    def batch(lens, mode=ForwardMode.EXTEND):
        reqs = [engine.make_req(list(range(5, 5 + n)), SamplingParams()) for n in lens]
        for req in reqs:
            engine.scheduler.add_request(req)
        built = engine.builder.build(engine.scheduler.get_next_batch_to_run())
        for req in reqs:
            engine.abort(req.rid)
        return built

    small = batch([20, 28])
    assert small.mode is ForwardMode.EXTEND and small.packed.shape == (3, 48) and graphs.can_run(small)
    assert not graphs.can_run(batch([20, 29]))  # 49 tokens
    assert not graphs.can_run(batch([4, 4, 4]))  # 3 requests
    eager = engine.runner._dummy_extend([8])  # no upload rows (the warm-up's batches)
    assert eager.packed is None and not graphs.can_run(eager)
