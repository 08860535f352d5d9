"""FP8 weight numerics (common/engine/models/fp8.py), on CPU: the per-channel and per-token scale
math, the checkpoint scale shapes, the GEMM paths against each other, and
merged layers against their parts."""

import pytest
import torch
from torch import nn

from pdserve.common.engine.models import fp8
from pdserve.common.engine.models.layers import merge_linears

# float8_e4m3fn has 3 mantissa bits: rounding to nearest is off by at most 2^-4 of the value in its
# normal range; below 2^-6 (subnormals, steps of 2^-9) by at most 2^-10, in units of the scale.
REL_ERR, SUBNORMAL_ERR = 2.0**-4, 2.0**-10


def rows_of_many_magnitudes(n: int = 24, k: int = 96) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=g) * 10.0 ** torch.linspace(-6, 4, n)[:, None]
    w[3, 5] = 50 * w[3].abs().max()  # an outlier in one row must not change the others' scales
    return w


def test_per_channel_round_trip_is_within_float8_rounding():
    w = rows_of_many_magnitudes()
    q, scale = fp8.quantize_per_channel(w)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32 and scale.shape == (w.shape[0],)
    assert torch.equal(scale, w.abs().amax(dim=1) / 448)
    assert torch.equal(q.float().abs().amax(dim=1), torch.full((w.shape[0],), 448.0)), "each row's amax is 448"
    back = q.float() * scale[:, None]
    bound = torch.maximum(w.abs() * REL_ERR, scale[:, None] * SUBNORMAL_ERR)
    assert ((back - w).abs() <= bound).all()
    assert (back - w).abs().max() > 0, "the values went through float8"


def test_a_zero_row_or_token_divides_nothing_by_zero():
    w = rows_of_many_magnitudes()
    w[7] = 0.0
    q, scale = fp8.quantize_per_channel(w)
    assert scale[7] == 1.0 and torch.isfinite(scale).all()
    assert torch.equal(q[7].float(), torch.zeros(w.shape[1]))
    assert torch.isfinite(q.float()).all()

    x = torch.randn(4, 32)
    x[2] = 0.0  # a padded row of a CUDA-graph batch
    xq, x_scale = fp8.quantize_per_token(x)
    assert x_scale.shape == (4, 1) and (x_scale > 0).all() and torch.isfinite(x_scale).all()
    assert torch.equal(xq[2].float(), torch.zeros(32)) and torch.isfinite(xq.float()).all()


def test_per_token_round_trip_and_scales():
    x = torch.randn(8, 64) * torch.logspace(-3, 3, 8)[:, None]
    xq, scale = fp8.quantize_per_token(x)
    assert torch.allclose(scale[:, 0], x.abs().amax(dim=1) / 448)
    assert torch.equal(xq.float().abs().amax(dim=1), torch.full((8,), 448.0)), "each token's amax is 448, no NaN"
    bound = torch.maximum(x.abs() * REL_ERR, scale * SUBNORMAL_ERR)
    assert ((xq.float() * scale - x).abs() <= bound).all()


PER_ROW = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
STORED_SCALES = {
    "channel [N, 1]": (torch.tensor(PER_ROW).reshape(6, 1), PER_ROW),
    "channel [N]": (torch.tensor(PER_ROW), PER_ROW),
    "tensor [1]": (torch.tensor([0.25]), [0.25] * 6),
    "tensor scalar": (torch.tensor(0.25), [0.25] * 6),
}


@pytest.mark.parametrize("form", STORED_SCALES)
def test_checkpoint_scales_become_one_per_row(form):
    stored, want = STORED_SCALES[form]
    scales = fp8.channel_scales(stored.to(torch.bfloat16), rows=6)
    assert scales.dtype == torch.float32 and scales.shape == (6,)
    assert scales.tolist() == want


def test_a_scale_of_another_size_is_refused():
    with pytest.raises(ValueError, match=r"expected \[6, 1\] \(per channel\) or \[1\]"):
        fp8.channel_scales(torch.ones(3, 1), rows=6)


def make_layer(out_features: int, in_features: int, bias: bool, seed: int) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(in_features, out_features, bias=bias)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpu_scaled_mm_computes_the_emulated_numbers(dtype):
    layer = fp8.Fp8Linear.quantize(make_layer(48, 80, True, 0).to(dtype))
    x = torch.randn(5, 80).to(dtype)
    xq, x_scale = fp8.quantize_per_token(x)
    assert fp8.scaled_mm_refusal(x, layer.weight) == "", "CPU takes torch._scaled_mm"
    got = layer(x)
    want = fp8.emulated_fp8_mm(xq, x_scale, layer.weight, layer.weight_scale, layer.bias, dtype)
    assert got.dtype == dtype and got.shape == (5, 48)
    torch.testing.assert_close(got, want, rtol=1e-5 if dtype == torch.float32 else 8e-3, atol=1e-5)


@pytest.mark.parametrize("dtype,bias", [(torch.float32, True), (torch.bfloat16, True), (torch.bfloat16, False)])
def test_the_tensorwise_path_computes_the_emulated_numbers(dtype, bias):
    """CUDA's path at decode sizes (fp8.TENSORWISE_MAX_TOKENS): a unit-scaled GEMM into fp32 sums,
    then the Triton epilogue (here interpreted) applies both scales and the bias and rounds once."""
    layer = fp8.Fp8Linear.quantize(make_layer(1100, 80, bias, 2).to(dtype))  # (N past one 1024 block)
    xq, x_scale = fp8.quantize_per_token(torch.randn(7, 80).to(dtype))
    got = fp8.tensorwise_fp8_mm(xq, x_scale, layer.weight, layer.weight_scale, layer.bias, dtype)
    want = fp8.emulated_fp8_mm(xq, x_scale, layer.weight, layer.weight_scale, layer.bias, dtype)
    assert got.dtype == dtype and got.shape == (7, 1100)
    torch.testing.assert_close(got, want, rtol=1e-5 if dtype == torch.float32 else 8e-3, atol=1e-5)


@pytest.mark.parametrize("m,n,k,bias", [(1, 96, 64, False), (7, 80, 176, True), (33, 64, 128, False)])
@pytest.mark.parametrize("tma", [True, False])
def test_the_triton_gemm_is_bitwise_the_tensorwise_path(m, n, k, bias, tma):
    """fp8_kernels.fp8_gemm (CUDA's path at decode sizes, here interpreted), its tiles read by TMA
    (Hopper) or by pointer: the tensor-wise path's numbers — unscaled sums, (sums * x scale) *
    weight scale + bias, one rounding — at tiles that leave partial blocks on every side (N, M, K)."""
    from pdserve.common.engine.models import fp8_kernels

    layer = fp8.Fp8Linear.quantize(make_layer(n, k, bias, 3).to(torch.bfloat16))
    xq, x_scale = fp8.quantize_per_token(torch.randn(m, k).to(torch.bfloat16))
    tiles = {"BLOCK_N": 32, "BLOCK_M": 16, "BLOCK_K": 32}
    got = fp8_kernels.fp8_gemm(xq, x_scale, layer.weight, layer.weight_scale, layer.bias, torch.bfloat16, tiles,
                               tma=tma)  # fmt: skip
    want = fp8.tensorwise_fp8_mm(xq, x_scale, layer.weight, layer.weight_scale, layer.bias, torch.bfloat16)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    assert torch.equal(got, want)


@pytest.mark.parametrize("split", [2, 4])
@pytest.mark.parametrize("tma", [True, False])
def test_the_triton_gemm_split_over_k_sums_its_parts_in_order(split, tma):
    """With SPLIT_K each program sums a K slice; the parts are added in order, then scaled: the same
    numbers up to the order of the fp32 sums, and the same bits run after run."""
    from pdserve.common.engine.models import fp8_kernels

    layer = fp8.Fp8Linear.quantize(make_layer(80, 256, True, 4).to(torch.bfloat16))
    xq, x_scale = fp8.quantize_per_token(torch.randn(9, 256).to(torch.bfloat16))
    tiles = {"BLOCK_N": 32, "BLOCK_M": 16, "BLOCK_K": 32, "SPLIT_K": split}
    got = fp8_kernels.fp8_gemm(xq, x_scale, layer.weight, layer.weight_scale, layer.bias, torch.bfloat16, tiles,
                               tma=tma)  # fmt: skip
    want = fp8.emulated_fp8_mm(xq, x_scale, layer.weight, layer.weight_scale, layer.bias, torch.bfloat16)
    torch.testing.assert_close(got, want, rtol=8e-3, atol=1e-5)
    assert torch.equal(got, fp8_kernels.fp8_gemm(xq, x_scale, layer.weight, layer.weight_scale, layer.bias,
                                                 torch.bfloat16, tiles, tma=tma))  # fmt: skip


@pytest.mark.parametrize("m,inter", [(1, 64), (7, 80), (20, 200)])
def test_the_fused_gate_up_is_the_gemm_then_silu_and_multiply(m, inter):
    """fp8_kernels.gate_up_silu_fp8 (interpreted): silu(gate) * up quantized per token, as fp8_gemm of
    the merged [gate; up] layer then silu_mul_fp8 give it, at intermediate sizes that leave a partial
    tile (80, 200: the gate tile's last rows are up's first, never stored)."""
    from pdserve.common.engine.models import fp8_kernels

    k = 96
    gate_up = fp8.Fp8Linear.quantize(make_layer(2 * inter, k, False, 5).to(torch.bfloat16))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    xq, x_scale = fp8.quantize_per_token(x.to(torch.bfloat16))
    args = (xq, x_scale, gate_up.weight, gate_up.weight_scale)
    tiles = {"BLOCK_N": 64, "BLOCK_M": 16, "BLOCK_K": 32}
    want_q, want_scale = fp8_kernels.silu_mul_fp8(
        fp8_kernels.fp8_gemm(*args, None, torch.bfloat16, tiles, tma=False), fp8.MIN_AMAX
    )
    got_q, got_scale = fp8_kernels.gate_up_silu_fp8(*args, torch.bfloat16, fp8.MIN_AMAX, block_k=32)
    assert got_q.dtype == torch.float8_e4m3fn and got_q.shape == (m, inter) and got_scale.shape == (m, 1)
    assert torch.equal(got_scale, want_scale)
    assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8))


def test_an_input_quantized_by_the_op_before_gives_the_layers_numbers():
    """fp8.Fp8Input (what a fused norm or silu-and-multiply hands an FP8 layer on CUDA) skips the
    layer's own quantization and nothing else."""
    layer = fp8.Fp8Linear.quantize(make_layer(48, 80, True, 5).to(torch.bfloat16))
    x = torch.randn(6, 80).to(torch.bfloat16)
    given = fp8.Fp8Input(*fp8.quantize_per_token(x), torch.bfloat16)
    assert given.shape == (6, 80) and given.device.type == "cpu"
    assert torch.equal(layer(given), layer(x))


def test_an_fp8_linear_approximates_the_float_one():
    linear = make_layer(64, 128, True, 1)
    x = torch.randn(3, 7, 128)  # any leading dims
    want = linear(x)
    got = fp8.Fp8Linear.quantize(linear)(x)
    assert got.shape == want.shape
    err = (got - want).norm() / want.norm()
    assert 1e-4 < err < 0.05, err  # quantized (not the float GEMM), within float8's error


def test_merged_layers_equal_their_parts_with_each_parts_scale():
    """Fused q/k/v (and gate/up) of an FP8 model: one GEMM, each row keeping its own scale, also
    for per-tensor checkpoints whose q, k and v scales differ."""
    parts = [fp8.Fp8Linear.quantize(make_layer(n, 64, True, seed)) for seed, n in enumerate((64, 32, 32))]
    for part, tensor_scale in zip(parts, (0.5, 2.0, 0.125)):
        part.weight_scale.data = fp8.channel_scales(torch.tensor([tensor_scale]), rows=part.out_features)
    merged = merge_linears(*parts)
    assert isinstance(merged, fp8.Fp8Linear) and merged.weight.dtype == torch.float8_e4m3fn
    assert merged.weight_scale.tolist() == [0.5] * 64 + [2.0] * 32 + [0.125] * 32
    x = torch.randn(9, 64)
    assert torch.equal(merged(x), torch.cat([p(x) for p in parts], dim=-1))


def test_fp8_and_float_layers_do_not_merge():
    with pytest.raises(TypeError, match="cannot merge FP8 and unquantized"):
        merge_linears(fp8.Fp8Linear.quantize(make_layer(8, 16, False, 0)), make_layer(8, 16, False, 1))


def test_quantize_linears_takes_every_linear_and_nothing_else():
    model = nn.ModuleDict(
        {"embed": nn.Embedding(10, 16), "proj": nn.Linear(16, 32), "inner": nn.Sequential(nn.Linear(32, 16), nn.ReLU())}
    )
    assert fp8.quantize_linears(model) == 2
    assert isinstance(model["proj"], fp8.Fp8Linear) and isinstance(model["inner"][0], fp8.Fp8Linear)
    assert model["embed"].weight.dtype == torch.float32


def test_an_fp8_layer_that_is_not_a_linear_is_refused():
    model = nn.ModuleDict({"lm_head": nn.Embedding(10, 16)})
    with pytest.raises(ValueError, match="linear layers of the transformer blocks only"):
        fp8.use_fp8_linears(model, ["lm_head"])


def test_the_gemm_bench_reads_the_projections_and_finds_the_crossover():
    """bench/micro/fp8_gemm.py (run on a GPU) sets fp8.TENSORWISE_MAX_TOKENS: its shapes and its verdict."""
    from pdserve.bench.micro.fp8_gemm import crossover, projections

    assert projections("llama/8b") == {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672),
                                       "down": (14336, 4096)}  # fmt: skip
    row = lambda m, t, r: {"tokens": m, "tensorwise_us": t, "rowwise_us": r}  # noqa: E731
    rows = [row(1, 5, 9), row(1, 5, 9), row(64, 8, 9), row(64, 2, 9), row(256, 20, 9), row(512, 1, 9)]
    assert crossover(rows, [1, 64, 256, 512]) == 64  # the first slower size ends it
    assert crossover([row(1, 10, 9)], [1]) == 0
    with pytest.raises(ValueError, match="Llama-family"):
        projections("gpt2/small")
