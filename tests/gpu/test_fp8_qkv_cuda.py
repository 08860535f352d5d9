"""The FP8 q/k/v GEMM with rotary and the KV store in its epilogue (models/fp8_qkv.py), served: the
same tokens and logprobs as the GEMM then rope_store_kv, with and without CUDA graphs, on a bf16 and a
float8 KV pool. The kernel's bits against the two launches: tests/test_fp8_qkv.py (compiled here too)."""

import random

import pytest

from pdserve.common.engine.engine import Engine
from pdserve.common.engine.models import fp8, llama
from pdserve.common.tiny_model import make_tiny_model
from pdserve.common.types import SamplingParams


@pytest.fixture(scope="module")
def wide_heads(tmp_path_factory):
    """A tiny Llama whose heads are 128 wide, as Llama-8B's (the kernel's row order is not the identity)."""
    return str(make_tiny_model(tmp_path_factory.mktemp("wide") / "llama", "llama", overrides={"head_dim": 128}))


@pytest.mark.parametrize("graphs", [True, False])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_the_fused_qkv_changes_no_token(wide_heads, graphs, kv_cache_dtype, monkeypatch):
    rng = random.Random(5)
    cases = [[0] + [rng.randrange(5, 512) for _ in range(rng.randrange(1, 150))] for _ in range(20)]
    params = SamplingParams(max_new_tokens=16, temperature=0, logprobs=0)
    kw = dict(model_path=wide_heads, device="cuda", dtype="bfloat16", max_total_tokens=16384, quantization="fp8",
              kv_cache_dtype=kv_cache_dtype)  # fmt: skip
    if not graphs:
        kw.update(disable_cuda_graph=True, prefill_cuda_graph_max_tokens=0)
    from pdserve.common.engine.models import fp8_qkv

    calls = []
    run = fp8_qkv.qkv_rope_store
    monkeypatch.setattr(fp8_qkv, "qkv_rope_store", lambda *a, **k: (calls.append(a[0].shape[0]), run(*a, **k))[1])
    fused = Engine(**kw)
    qkv = fused.runner.model.model.layers[0].self_attn.qkv_proj
    assert qkv.rope_head_dim == 128 and qkv.column_order is not None
    got = fused.generate(cases, params)
    assert calls, "the fused kernel never ran"
    with monkeypatch.context() as m:
        m.setattr(llama, "fp8_qkv_fits", lambda *a: False)
        unfused = Engine(**kw)
    assert unfused.runner.model.model.layers[0].self_attn.qkv_proj.rope_head_dim is None
    want = unfused.generate(cases, params)
    assert [c.output_ids for c in got] == [c.output_ids for c in want]
    assert [[lp.logprob for lp in c.logprobs] for c in got] == [[lp.logprob for lp in c.logprobs] for c in want]
    assert fused.is_idle() and unfused.is_idle()


def test_prefill_past_the_decode_gemm_puts_the_columns_back(wide_heads, monkeypatch):
    """Prompts of more tokens than TRITON_MAX_TOKENS run the permuted q/k/v through torch._scaled_mm:
    the same first tokens as an engine that never permuted."""
    prompts = [[0] + [7 + i % 400 for i in range(300)], [0] + [11 + i % 300 for i in range(260)]]
    params = SamplingParams(max_new_tokens=4, temperature=0)
    kw = dict(model_path=wide_heads, device="cuda", dtype="bfloat16", max_total_tokens=16384, quantization="fp8")
    got = [c.output_ids for c in Engine(**kw).generate(prompts, params)]
    monkeypatch.setattr(llama, "fp8_qkv_fits", lambda *a: False)
    assert got == [c.output_ids for c in Engine(**kw).generate(prompts, params)]
    assert fp8.TRITON_MAX_TOKENS < 260
