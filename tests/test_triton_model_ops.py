"""The fused model kernels (models/triton_ops.py) against the eager HF-arithmetic layers they
replace, in fp32 and fp16, on random inputs (the interpreter on CPU; compiled on a GPU)."""

import pytest
import torch
from torch.nn import functional as F

from pdserve.common.engine.models import triton_ops
from pdserve.common.engine.models.layers import RMSNorm, RotaryEmbedding, gelu_tanh

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
# The interpreter mishandles bf16; compiled kernels on a GPU are checked in it too.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def rel_err(out, ref):
    assert not torch.isnan(out).any(), "an element was not written (or is NaN)"
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [48, 100])
def test_rmsnorm_with_and_without_residual(dtype, n):
    g = torch.Generator().manual_seed(n)
    norm = RMSNorm(n, 1e-6).to(DEVICE, dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(n, generator=g))
    # Rows strided inside a wider buffer, as a slice of a bigger activation would be.
    wide = torch.randn(7, n + 5, generator=g).to(DEVICE, dtype)
    x = wide[:, :n]
    ref = norm._norm(x)
    assert rel_err(triton_ops.rmsnorm(x, norm.weight, 1e-6), ref) < TOL[dtype]

    residual = torch.randn(7, n, generator=g).to(DEVICE, dtype)
    ref_sum = residual + x
    out = triton_ops.rmsnorm(x, norm.weight, 1e-6, residual)  # updates residual in place
    assert torch.equal(residual, ref_sum)
    assert rel_err(out, norm._norm(ref_sum)) < TOL[dtype]


def test_rmsnorm_of_no_rows():
    weight = torch.ones(16, device=DEVICE)
    assert triton_ops.rmsnorm(torch.empty(0, 16, device=DEVICE), weight, 1e-6).shape == (0, 16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 16), (8, 2, 32), (6, 3, 24)])
def test_rope_in_place_on_fused_qkv_views(dtype, heads, kv_heads, head_dim):
    g = torch.Generator().manual_seed(heads * head_dim)
    tokens = 9
    rope = {"rope_theta": 10000.0}
    rotary = RotaryEmbedding(head_dim, rope).to(DEVICE)
    rotary.init_buffers()
    positions = torch.randint(0, 3000, (tokens,), generator=g).to(DEVICE)
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    qkv = torch.randn(tokens, q_size + 2 * kv_size, generator=g).to(DEVICE, dtype)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q, k = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)
    ref_q, ref_k = rotary(positions, q.clone(), k.clone())  # the eager path
    v_before = v.clone()
    triton_ops.rope_(q, k, positions, rotary.inv_freq)
    assert rel_err(q, ref_q) < TOL[dtype] and rel_err(k, ref_k) < TOL[dtype]
    assert torch.equal(v, v_before), "rotary touched v"


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_of_a_fused_gate_up(dtype):
    g = torch.Generator().manual_seed(3)
    gate_up = (3 * torch.randn(5, 2 * 1100, generator=g)).to(DEVICE, dtype)  # > one 1024 block
    gate, up = gate_up.chunk(2, dim=-1)
    assert rel_err(triton_ops.silu_mul(gate_up), F.silu(gate) * up) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_tanh(dtype):
    g = torch.Generator().manual_seed(4)
    x = (4 * torch.randn(3, 1500, generator=g)).to(DEVICE, dtype)
    x[0, :4] = torch.tensor([-30.0, 30.0, 0.0, -1e-3])  # both tails and zero
    assert rel_err(triton_ops.gelu_tanh(x), gelu_tanh(x.float()).to(dtype)) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [48, 100])
def test_layernorm_with_and_without_residual(dtype, n):
    g = torch.Generator().manual_seed(n + 1)
    norm = torch.nn.LayerNorm(n, eps=1e-5).to(DEVICE, dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(n, generator=g))
        norm.bias.copy_(0.1 * torch.randn(n, generator=g))
    wide = (3 + torch.randn(7, n + 5, generator=g)).to(DEVICE, dtype)  # a mean far from 0
    x = wide[:, :n]
    assert rel_err(triton_ops.layernorm(x, norm.weight, norm.bias, 1e-5), norm(x)) < TOL[dtype]
    residual = torch.randn(7, n, generator=g).to(DEVICE, dtype)
    ref_sum = residual + x
    out = triton_ops.layernorm(x, norm.weight, norm.bias, 1e-5, residual)
    assert torch.equal(residual, ref_sum)
    assert rel_err(out, norm(ref_sum)) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpt2_fused_mlp_matches_eager(dtype):
    """The fused GPT-2 MLP (half precision: c_fc + gelu_new as one GEMM with a GELU epilogue;
    fp32: the two-step path) against the eager HF-arithmetic MLP."""
    from pdserve.common.engine.models.gpt2 import GPT2MLP
    from pdserve.common.engine.tp import TPGroup

    class Arch:
        hidden, inner = 64, 256

    torch.manual_seed(0)
    mlp = GPT2MLP(Arch(), TPGroup.single(torch.device(DEVICE))).to(DEVICE, dtype)
    x = torch.randn(9, 64).to(DEVICE, dtype)
    ref = mlp(x)
    mlp.fused = True
    out = mlp(x)
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [1, 50, 257, 5000])
def test_argmax_rows_matches_torch(dtype, vocab):
    g = torch.Generator().manual_seed(vocab)
    wide = torch.randn(6, vocab + 7, generator=g).to(DEVICE, dtype)
    x = wide[:, :vocab]  # rows strided, as sliced logits are
    if vocab > 1:
        x[1, vocab // 3] = x[1, vocab - 1] = 100.0  # a tie: the first index wins
        x[2] = float("-inf")  # an all -inf row: index 0, as torch
        x[3, vocab // 2] = float("inf")
    out = triton_ops.argmax_rows(x, block=64, num_warps=4)
    assert out.dtype == torch.int64 and torch.equal(out, x.argmax(dim=-1))


@pytest.mark.parametrize("vocab", [33, 257, 5000])
def test_argmax_rows_under_a_bitmask_is_the_argmax_of_the_masked_logits(vocab):
    """The greedy sampling of grammar rows: the bitmask applied as the kernel reads equals
    apply_bitmask's masked copy then argmax (ties, NaN and rows allowing one token included)."""
    from pdserve.common.engine.grammar import apply_bitmask, bitmask_words

    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(5, vocab, generator=g).to(DEVICE, torch.bfloat16)
    words = torch.randint(-(2**31), 2**31 - 1, (5, bitmask_words(vocab)), generator=g, dtype=torch.int64).to(
        torch.int32
    )
    words[0] = 0
    words[0, (vocab - 1) // 32] = 1 << ((vocab - 1) % 32)  # only the last token
    words[1] = -1  # everything: bit 31 of each word included
    x[1, 0] = float("nan")  # allowed NaN counts as the maximum, as torch
    x[2, 3] = float("nan")
    words[2, 0] &= ~(1 << 3)  # a masked NaN is -inf
    x[3] = 1.0  # a tie among the allowed tokens: the first allowed wins
    words = words.to(DEVICE)
    out = triton_ops.argmax_rows(x, block=64, num_warps=4, bitmask=words)
    assert torch.equal(out, apply_bitmask(x, words).argmax(dim=-1))
    assert out[0].item() == vocab - 1 and out[1].item() == 0
