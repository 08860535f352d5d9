"""The FP8 KV cache on CUDA: the Triton stores and attention kernels (decode, extend, the CUDA-graph
paths) compiled for the GPU, against tests/test_fp8_kv_cache.py's yardstick (the unquantized engine
whose stored K and V are rounded through float8 by plain torch casts with the same scales), and
replayed from CUDA graphs giving the eager tokens."""

import pytest
import torch

from tests.test_fp8_kv_cache import agreement, engine_for, reference_engine, top1_and_greedy

FP8 = torch.float8_e4m3fn
CUDA = dict(device="cuda", dtype="bfloat16", max_total_tokens=16384)


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_fp8_kv_on_cuda_agrees_like_the_reference_and_graphs_give_the_eager_tokens(arch, overlap, tiny_models):
    path = tiny_models(arch)
    unquantized = engine_for(path, **CUDA)
    base_top1, _, base_logprobs = top1_and_greedy(unquantized)

    flags = dict(kv_cache_dtype="fp8_e4m3", attention_backend="triton", disable_overlap_schedule=not overlap)
    fp8 = engine_for(path, **flags, **CUDA)
    pool = fp8.runner.kv_pool
    assert pool.quantized and all(b.dtype == FP8 for b in pool.k_storage + pool.v_storage)
    assert pool.scales_set and bool((pool.k_scales != 1).all())
    top1, greedy, logprobs = top1_and_greedy(fp8)
    assert fp8.runner.cuda_graphs.replays > 0
    assert max(abs(a - b) for x, y in zip(logprobs, base_logprobs) for a, b in zip(x, y)) > 1e-4

    ref = reference_engine(path, pool.k_scales.clone(), pool.v_scales.clone(), attention_backend="torch_native", **CUDA)
    ref_top1, ref_greedy, _ = top1_and_greedy(ref)
    ours = agreement(unquantized, top1, greedy, base_top1)
    theirs = agreement(unquantized, ref_top1, ref_greedy, base_top1)
    print(f"agreement {arch} overlap={overlap} on CUDA: fp8 {ours:.3f}, reference {theirs:.3f}")
    assert ours >= theirs - 0.05, (ours, theirs)

    eager = engine_for(path, **flags, disable_cuda_graph=True, prefill_cuda_graph_max_tokens=0, **CUDA)
    assert torch.equal(eager.runner.kv_pool.k_scales, pool.k_scales)  # calibration is deterministic
    assert top1_and_greedy(eager)[1] == greedy


@pytest.mark.parametrize("widen_to_f16", [True, False])
def test_decode_kernel_reads_float8_for_a_bf16_model_in_fp16_or_bf16(widen_to_f16, monkeypatch):
    """triton_decode.FP8_WIDEN_TO_F16 on and off, compiled: both within bf16's rounding of attention
    computed in fp32 over the dequantized pool, at a Llama-8B head geometry and 1024 keys."""
    from pdserve.common.engine.attention import triton_decode
    from pdserve.common.engine.kv_pool import PagedKVPool

    monkeypatch.setattr(triton_decode, "FP8_WIDEN_TO_F16", widen_to_f16)
    heads, kv_heads, dim, tokens, batch = 32, 8, 128, 1024, 4
    g = torch.Generator(device="cuda").manual_seed(0)
    pool = PagedKVPool(1 + batch * tokens // 16, 16, 1, kv_heads, dim, FP8, "cuda")
    pool.set_scales(torch.tensor([0.02], device="cuda"), torch.tensor([0.01], device="cuda"))
    slots = torch.arange(16, 16 + batch * tokens, device="cuda")
    k = torch.randn(batch * tokens, kv_heads, dim, device="cuda", generator=g) * 2
    pool.set_kv(0, slots, k, torch.randn(k.shape, device="cuda", generator=g))
    r2t = slots.view(batch, tokens).int()
    q = (torch.randn(batch, heads, dim, device="cuda", generator=g) * 3).bfloat16()
    out = torch.empty_like(q)
    work = triton_decode.DecodeWorkspace(batch, heads, dim, 4, "cuda")
    rows, lens = torch.arange(batch, device="cuda"), torch.full((batch,), tokens, device="cuda")
    scales = dict(k_scale=pool.k_scales[:1], v_scale=pool.v_scales[:1])
    triton_decode.decode_attention(
        q, pool.k_buffers[0], pool.v_buffers[0], out, r2t, rows, lens, 0.1, None, 2, work, **scales
    )
    keys, values = pool.read_kv(0, r2t.long(), torch.float32)  # [B, L, KVH, D]
    keys, values = keys.repeat_interleave(heads // kv_heads, 2), values.repeat_interleave(heads // kv_heads, 2)
    probs = (torch.einsum("bhd,blhd->bhl", q.float(), keys) * 0.1).softmax(-1)
    expected = torch.einsum("bhl,blhd->bhd", probs, values)
    error = (out.float() - expected).abs().max().item()
    print(f"widen_to_f16={widen_to_f16}: max error {error:.2e} of {expected.abs().max().item():.2e}")
    assert error < 0.02 * expected.abs().max().item(), error


@pytest.mark.parametrize("widen_to_f16", [True, False])
def test_extend_kernel_over_a_float8_prefix_for_a_bf16_model(widen_to_f16, monkeypatch):
    """triton_extend.FP8_WIDEN_TO_F16 on and off, compiled: a bf16 prompt of 300 new tokens after
    1000 cached ones (read through float8), within bf16's rounding of attention in fp32 over the
    dequantized prefix and the new tokens' own K and V."""
    from pdserve.common.engine.attention import triton_extend
    from pdserve.common.engine.kv_pool import PagedKVPool

    monkeypatch.setattr(triton_extend, "FP8_WIDEN_TO_F16", widen_to_f16)
    heads, kv_heads, dim, prefix, new = 32, 8, 128, 1000, 300
    total, g = prefix + new, torch.Generator(device="cuda").manual_seed(0)
    pool = PagedKVPool(2 + total // 16, 16, 1, kv_heads, dim, FP8, "cuda")
    pool.set_scales(torch.tensor([0.02], device="cuda"), torch.tensor([0.01], device="cuda"))
    slots = torch.randperm(total, device="cuda", generator=g) + 16
    k = torch.randn(total, kv_heads, dim, device="cuda", generator=g) * 2
    v = torch.randn(total, kv_heads, dim, device="cuda", generator=g)
    pool.set_kv(0, slots, k, v)
    q = (torch.randn(new, heads, dim, device="cuda", generator=g) * 3).bfloat16()
    out = torch.empty_like(q)
    i32 = dict(dtype=torch.int32, device="cuda")
    lens = torch.tensor([total], **i32), torch.tensor([new], **i32), torch.tensor([0], **i32)
    k_new, v_new = k[prefix:].bfloat16(), v[prefix:].bfloat16()
    triton_extend.extend_attention(q, pool.k_buffers[0], pool.v_buffers[0], out, slots[None].int(),
                                   torch.tensor([0], device="cuda"), *lens, new, 0.1, None, *pool.layer_scales(0),
                                   k_new, v_new)  # fmt: skip
    keys, values = pool.read_kv(0, slots, torch.float32)
    keys[prefix:], values[prefix:] = k_new.float(), v_new.float()
    keys, values = keys.repeat_interleave(heads // kv_heads, 1), values.repeat_interleave(heads // kv_heads, 1)
    scores = torch.einsum("thd,shd->hts", q.float(), keys) * 0.1
    causal = torch.arange(total, device="cuda")[None] > torch.arange(prefix, total, device="cuda")[:, None]
    expected = torch.einsum("hts,shd->thd", scores.masked_fill(causal, float("-inf")).softmax(-1), values)
    error = (out.float() - expected).abs().max().item()
    print(f"extend widen_to_f16={widen_to_f16}: max error {error:.2e} of {expected.abs().max().item():.2e}")
    assert error < 0.02 * expected.abs().max().item(), error
