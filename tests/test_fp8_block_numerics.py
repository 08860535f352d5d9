"""Block-wise FP8 numerics (common/engine/models/fp8_block.py), on CPU: the block and per-token-group
scale math, the CPU reference GEMM against the per-group sum it stands for, the Triton kernels
(fp8_block_kernels.py, interpreted here: TRITON_INTERPRET=1 from tests/conftest.py) against the
torch ones, merged layers, and the block sizes refused."""

import pytest
import torch
from torch import nn

from pdserve.common.engine.models import fp8, fp8_block
from pdserve.common.engine.models.layers import merge_linears

FP8 = torch.float8_e4m3fn
# float8_e4m3fn rounding: within 2^-4 of the value in its normal range, 2^-10 of the scale below it.
REL_ERR, SUBNORMAL_ERR = 2.0**-4, 2.0**-10


def tiles_of_many_magnitudes(n: int = 200, k: int = 320, block=(128, 128)) -> torch.Tensor:
    """A weight whose tiles differ in magnitude by decades (one scale per row would flatten the small ones)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=g)
    rows, cols = fp8_block.scale_shape(n, k, block)
    for i in range(rows):
        for j in range(cols):
            w[i * block[0] : (i + 1) * block[0], j * block[1] : (j + 1) * block[1]] *= 10.0 ** (2 * i - 3 * j)
    return w


def test_block_scales_round_trip_within_float8_rounding_partial_tiles_included():
    w = tiles_of_many_magnitudes()  # 200 x 320: the last row tile holds 72 rows, the last column tile 64
    w[128:, 256:] = 0.0  # a zero tile divides nothing by zero
    q, scale = fp8_block.quantize_blockwise(w, (128, 128))
    assert q.dtype == FP8 and q.shape == w.shape and q.is_contiguous()
    assert scale.dtype == torch.float32 and scale.shape == (2, 3)
    assert scale[1, 2] == 1.0 and torch.equal(q[128:, 256:].float(), torch.zeros(72, 64))
    for i, rows in enumerate((slice(0, 128), slice(128, 200))):
        for j, cols in enumerate((slice(0, 128), slice(128, 256), slice(256, 320))):
            if (i, j) == (1, 2):
                continue
            assert scale[i, j] == w[rows, cols].abs().amax() / 448, (i, j)
            assert q[rows, cols].float().abs().amax() == 448.0, "each tile's amax is 448"
    full = fp8_block.expand_scales(scale, w.shape, (128, 128))
    back = q.float() * full
    assert ((back - w).abs() <= torch.maximum(w.abs() * REL_ERR, full * SUBNORMAL_ERR)).all()
    assert (back - w).abs().max() > 0, "the values went through float8"


def test_per_token_group_scales_and_a_partial_last_group():
    x = torch.randn(6, 100) * torch.logspace(-3, 3, 6)[:, None]
    x[:, 64:] *= 1000.0  # the second group's large values must not flatten the first's
    x[2] = 0.0  # a padded row of a CUDA-graph batch
    xq, scale = fp8_block.quantize_per_token_group(x, 64)
    assert xq.shape == (6, 100) and xq.is_contiguous() and scale.shape == (6, 2)
    assert torch.allclose(scale[:, 0], (x[:, :64].abs().amax(dim=1) / 448).clamp(min=fp8.MIN_AMAX / 448))
    assert torch.allclose(scale[:, 1], (x[:, 64:].abs().amax(dim=1) / 448).clamp(min=fp8.MIN_AMAX / 448))
    assert torch.isfinite(xq.float()).all() and torch.equal(xq[2].float(), torch.zeros(100))
    full = scale.repeat_interleave(64, 1)[:, :100]
    assert ((xq.float() * full - x).abs() <= torch.maximum(x.abs() * REL_ERR, full * SUBNORMAL_ERR)).all()


def test_the_reference_gemm_is_the_sum_of_each_groups_scaled_products():
    """emulated_block_fp8_mm dequantizes; what the checkpoints define (and the Triton GEMM computes) is
    each K group's float8 dot product times its two scales, summed: the same number up to fp32 order."""
    block = (64, 32)
    layer = fp8_block.Fp8BlockLinear.quantize(nn.Linear(100, 150, bias=True), block)
    xq, sx = fp8_block.quantize_per_token_group(torch.randn(7, 100), block[1])
    want = layer.bias.detach().clone().expand(7, 150).clone()
    sw_rows = layer.weight_scale.repeat_interleave(block[0], 0)[:150]
    for g in range(sx.shape[1]):
        cols = slice(g * 32, (g + 1) * 32)
        want += (xq[:, cols].double() @ layer.weight[:, cols].double().t()).float() * sw_rows[:, g] * sx[:, g : g + 1]
    got = fp8_block.emulated_block_fp8_mm(xq, sx, layer.weight, layer.weight_scale, block, layer.bias, torch.float32)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("group", [32, 128])
def test_the_triton_group_quantization_is_bitwise_the_torch_ops(dtype, group):
    """(fp32 and fp16: Triton's interpreter mishandles bf16; tests/gpu covers bf16.)"""
    from pdserve.common.engine.models import fp8_block_kernels

    x = torch.randn(9, 2 * 300, generator=torch.Generator().manual_seed(0)) * torch.logspace(-4, 4, 9)[:, None]
    x[6, 10], x[6, 12] = -1e-6 * x[6].abs().max(), -0.0  # round to -0, not +0
    x = x[:, ::2].to(dtype)  # strided, and a partial last group
    x[4] = 0.0
    got_q, got_scale = fp8_block_kernels.quantize_per_token_group(x, group, fp8.MIN_AMAX)
    want_q, want_scale = fp8_block.quantize_per_token_group(x, group)
    assert torch.equal(got_scale, want_scale)
    assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8))


GEMM_CASES = {  # (tokens, N, K, [block_n, block_k], bias): partial tiles on every side
    "128 blocks, partial N and K": (5, 200, 320, (128, 128), True),
    "rows past the tile of 64": (17, 96, 64, (32, 32), False),
    "one scale row per row (merged)": (3, 40, 100, (1, 32), True),
    "more tokens than a tile": (40, 72, 256, (64, 64), False),
}


@pytest.mark.parametrize("case", GEMM_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_triton_block_gemm_agrees_with_the_reference(case, dtype):
    from pdserve.common.engine.models import fp8_block_kernels

    m, n, k, block, bias = GEMM_CASES[case]
    torch.manual_seed(m)
    layer = fp8_block.Fp8BlockLinear.quantize(nn.Linear(k, n, bias=bias).to(dtype), block)
    xq, sx = fp8_block.quantize_per_token_group(torch.randn(m, k).to(dtype), block[1])
    args = (xq, sx, layer.weight, layer.weight_scale, block, layer.bias, dtype)
    tiles = {"BLOCK_N": 32, "BLOCK_M": 16}
    got = fp8_block_kernels.block_fp8_gemm(*args, tiles)
    want = fp8_block.emulated_block_fp8_mm(*args)
    assert got.dtype == dtype and got.shape == (m, n)
    # The same float8 operands and scales: only the order of the fp32 sums (and one rounding) differ.
    torch.testing.assert_close(got, want, rtol=1e-5 if dtype == torch.float32 else 1e-3, atol=1e-4)
    assert torch.equal(fp8_block_kernels.block_fp8_gemm(*args), fp8_block_kernels.block_fp8_gemm(*args))


@pytest.mark.parametrize("case", GEMM_CASES)
@pytest.mark.parametrize("split", [2, 3])
def test_the_block_gemm_split_over_k_gives_the_reference_numbers(case, split):
    """K split (gemm_config's, where the decode grid has too few programs): each split's scaled sums
    in fp32 partials, added in order with the bias once; a split past the last group adds zeros."""
    from pdserve.common.engine.models import fp8_block_kernels

    m, n, k, block, bias = GEMM_CASES[case]
    torch.manual_seed(m)
    layer = fp8_block.Fp8BlockLinear.quantize(nn.Linear(k, n, bias=bias), block)
    xq, sx = fp8_block.quantize_per_token_group(torch.randn(m, k), block[1])
    args = (xq, sx, layer.weight, layer.weight_scale, block, layer.bias, torch.float32)
    got = fp8_block_kernels.block_fp8_gemm(*args, {"BLOCK_N": 32, "BLOCK_M": 16, "SPLIT_K": split})
    torch.testing.assert_close(got, fp8_block.emulated_block_fp8_mm(*args), rtol=1e-5, atol=1e-4)


def test_the_decode_split_depends_on_the_weight_alone():
    """gemm_config splits K for Llama-8B's narrow projections at decode sizes, the same for every
    token count up to 128 (a CUDA graph's padded batch and the eager one sum alike)."""
    from pdserve.common.engine.models.fp8_block_kernels import gemm_config

    layers = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
    splits = {
        name: {gemm_config(m, n, k, 128)["SPLIT_K"] for m in (1, 7, 64, 100, 128)} for name, (n, k) in layers.items()
    }
    assert splits == {"qkv": {2}, "o_proj": {4}, "gate_up": {1}, "down": {4}}
    assert gemm_config(129, 4096, 14336, 128)["SPLIT_K"] == 1  # prefill tiles: programs enough


def test_block_scales_follow_tiles_that_per_channel_scales_flatten():
    """Where a row's tiles differ in magnitude, one scale per row pushes the small tiles into
    float8's subnormals; block scales keep them: the block layer is closer to the float one."""
    linear = nn.Linear(320, 200, bias=False)
    with torch.no_grad():
        linear.weight.copy_(tiles_of_many_magnitudes())
    x = torch.zeros(8, 320)
    x[:, 256:] = torch.randn(8, 64)  # inputs on the last column tile only: 1e-6 to 1e-4 of the rows' amax
    want = linear(x)
    err_block = ((fp8_block.Fp8BlockLinear.quantize(linear)(x) - want).norm() / want.norm()).item()
    err_channel = ((fp8.Fp8Linear.quantize(linear)(x) - want).norm() / want.norm()).item()
    print(f"relative error: block scales {err_block:.3g}, per-channel {err_channel:.3g}")
    assert 1e-4 < err_block < 0.05 and err_channel > 0.3


@pytest.mark.parametrize("sizes,block_n", [((256, 128, 128), 128), ((64, 32, 32), 1)])
def test_merged_block_layers_equal_their_parts(sizes, block_n):
    """Fused q/k/v: whole row tiles concatenate with their scales; parts that end inside a tile
    (64 rows of 128-row tiles: tiny models, GQA shapes) take one scale row per weight row."""
    parts = [fp8_block.Fp8BlockLinear.quantize(nn.Linear(320, n, bias=True), (128, 128)) for n in sizes]
    merged = merge_linears(*parts)
    assert isinstance(merged, fp8_block.Fp8BlockLinear) and merged.block == (block_n, 128)
    assert merged.weight_scale.shape == fp8_block.scale_shape(sum(sizes), 320, merged.block)
    x = torch.randn(5, 320)
    torch.testing.assert_close(merged(x), torch.cat([p(x) for p in parts], dim=-1), rtol=1e-6, atol=1e-6)


def test_block_layers_merge_with_nothing_else_and_odd_blocks_are_refused():
    linear = nn.Linear(64, 32)
    with pytest.raises(TypeError, match="cannot merge block-wise FP8 layers with other layers"):
        merge_linears(fp8_block.Fp8BlockLinear.quantize(linear, (32, 32)), fp8.Fp8Linear.quantize(linear))
    with pytest.raises(ValueError, match="different blocks"):
        merge_linears(*(fp8_block.Fp8BlockLinear.quantize(linear, b) for b in ((32, 32), (32, 64))))
    for block in ((128, 96), (128, 16), (0, 128), (128, 512)):
        with pytest.raises(ValueError, match=r"block_k one of \[32, 64, 128, 256\]"):
            fp8_block.Fp8BlockLinear.quantize(linear, block)
    with pytest.raises(ValueError, match=r"fp32 \[1, 2\] block scales"):
        fp8_block.Fp8BlockLinear(torch.zeros(32, 64, dtype=FP8), torch.ones(1, 1), None, (32, 32))


@pytest.mark.parametrize("block", [(128, 128), (1, 64)])
def test_the_cuda_dispatch_runs_the_kernels_and_gives_the_reference_numbers(block, monkeypatch):
    """fp8_block.block_fp8_linear's CUDA branch (group quantization, then the block GEMM), interpreted
    on CPU tensors: the layer's own call, leading dims and bias included, as the CPU reference gives it."""
    linear = nn.Linear(200, 150, bias=True)
    layer = fp8_block.Fp8BlockLinear.quantize(linear, block)
    x = torch.randn(2, 3, 200)
    want = layer(x)
    monkeypatch.setattr(fp8_block, "gemm_refusal", lambda rows: "")
    got = layer(x)
    assert got.shape == (2, 3, 150)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
