"""rope_store_kv (attention/triton_store.py) against the two launches it fuses, rope_ then
store_kv: bitwise the same q, k and pool (the interpreter on CPU; compiled on a GPU)."""

import pytest
import torch

from pdserve.common.engine.attention import triton_store
from pdserve.common.engine.attention.triton_store import rope_store_kv, store_kv
from pdserve.common.engine.models import triton_ops
from pdserve.common.engine.models.layers import rope_inv_freq

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The interpreter mishandles bf16; compiled kernels on a GPU are checked in it too.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
POOL = 64


def fused_qkv(tokens, heads, kv_heads, head_dim, dtype, gen):
    """q, k, v as strided views of one fused projection output, as the fused Llama path has them."""
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    qkv = (4 * torch.randn(tokens, q_size + 2 * kv_size, generator=gen)).to(DEVICE, dtype)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    return q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim), v.view(tokens, kv_heads, head_dim)


def both_ways(tokens, heads, kv_heads, head_dim, dtype, loc, seed, pool_dtype=None):
    """((q, k, k_buf, v_buf) after rope_ + store_kv, the same after rope_store_kv, v before, v after)."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = fused_qkv(tokens, heads, kv_heads, head_dim, dtype, gen)
    positions = torch.randint(0, 5000, (tokens,), generator=gen).to(DEVICE)
    inv_freq = rope_inv_freq(head_dim, {"rope_theta": 500000.0}).to(DEVICE)
    k_buf = torch.randn(POOL, kv_heads, head_dim, generator=gen).to(DEVICE, pool_dtype or dtype)
    v_buf = torch.randn(POOL, kv_heads, head_dim, generator=gen).to(DEVICE, pool_dtype or dtype)

    ref = [q.clone(), k.clone(), k_buf.clone(), v_buf.clone()]
    triton_ops.rope_(ref[0], ref[1], positions, inv_freq)
    store_kv(ref[2], ref[3], loc, ref[1], v)
    v_before = v.clone()
    rope_store_kv(q, k, v, positions, inv_freq, k_buf, v_buf, loc)
    return ref, [q, k, k_buf, v_buf], v_before, v


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 16), (8, 4, 32), (8, 2, 24), (12, 3, 64)])
@pytest.mark.parametrize("tokens", [1, 7, 13])
@pytest.mark.parametrize("head_groups", [True, False])
def test_rope_store_kv_is_bitwise_rope_then_store(dtype, heads, kv_heads, head_dim, tokens, head_groups, monkeypatch):
    """With a program per token and KV head group (a decode step's few tokens) and per token (many)."""
    if not head_groups:
        monkeypatch.setattr(triton_store, "_FEW_TOKENS", 0)
    loc = (torch.randperm(POOL - 1, generator=torch.Generator().manual_seed(tokens))[:tokens] + 1).to(DEVICE)
    ref, out, v_before, v = both_ways(tokens, heads, kv_heads, head_dim, dtype, loc, seed=heads * head_dim + tokens)
    for name, a, b in zip(["q", "k", "k_buf", "v_buf"], ref, out):
        assert torch.equal(a, b), f"{name} differs"
    assert torch.equal(v, v_before), "v was modified"


def test_rope_store_kv_casts_to_the_pool_dtype():
    loc = torch.arange(1, 6, device=DEVICE)
    ref, out, _, _ = both_ways(5, 8, 2, 32, torch.float32, loc, seed=5, pool_dtype=torch.float16)
    for name, a, b in zip(["q", "k", "k_buf", "v_buf"], ref, out):
        assert torch.equal(a, b), f"{name} differs"


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_store_kv_padded_tokens_write_slot_0(dtype):
    # A CUDA-graph batch of 5 real rows padded to 9: the padding rows all write slot 0.
    loc = torch.tensor([3, 17, 9, 40, 22, 0, 0, 0, 0], device=DEVICE)
    ref, out, _, _ = both_ways(9, 8, 4, 32, dtype, loc, seed=11)
    assert torch.equal(ref[0], out[0]) and torch.equal(ref[1], out[1])
    # Which padded row lands last in slot 0 is a race on a GPU: compare every other slot.
    for a, b in zip(ref[2:], out[2:]):
        assert torch.equal(a[1:], b[1:])


def test_rope_store_kv_of_no_tokens_is_a_no_op():
    ref, out, _, _ = both_ways(0, 4, 2, 16, torch.float32, torch.empty(0, dtype=torch.int64, device=DEVICE), seed=0)
    for a, b in zip(ref, out):
        assert torch.equal(a, b)
