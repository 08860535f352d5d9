"""FP8 weights on CUDA: the Triton per-token quantization against torch's ops, torch._scaled_mm
(cuBLASLt, row-wise scales) against the emulated path on Llama-3.2-1B's linear shapes, and a tiny
model served with --quantization fp8 giving the same greedy tokens replayed from CUDA graphs as
run eagerly."""

import random

import pytest
import torch

from pdserve.common.engine.engine import Engine
from pdserve.common.engine.models import fp8
from pdserve.common.types import SamplingParams

if torch.cuda.get_device_capability() < (8, 9):
    pytest.skip("FP8 GEMMs need compute capability 8.9+", allow_module_level=True)

# Llama-3.2-1B (hidden 2048, 32 heads, 8 KV heads of 64, MLP 8192), fused as the CUDA path runs it:
# (N, K) of qkv, o, gate_up, down.
LLAMA_1B = {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192)}


@pytest.mark.parametrize("width", [40, 2048, 8192, 14336])
def test_the_triton_quantization_is_bitwise_the_torch_ops(width):
    from pdserve.common.engine.models import fp8_kernels

    x = torch.randn(130, 2 * width, device="cuda").bfloat16()[:, ::2]  # strided, as a view may be
    x = x * torch.logspace(-4, 4, 130, device="cuda").bfloat16()[:, None]
    x[7] = 0.0  # a padded row
    got_q, got_scale = fp8_kernels.quantize_per_token(x, fp8.MIN_AMAX)
    want_q, want_scale = fp8.quantize_per_token(x)
    assert torch.equal(got_scale, want_scale)
    assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8))


@pytest.mark.parametrize("batch", [1, 64, 128])
@pytest.mark.parametrize("layer", LLAMA_1B)
def test_scaled_mm_agrees_with_the_emulated_path(layer, batch):
    n, k = LLAMA_1B[layer]
    g = torch.Generator(device="cuda").manual_seed(0)
    weight = torch.randn(n, k, device="cuda", generator=g).bfloat16() * 0.02
    bias = torch.randn(n, device="cuda", generator=g).bfloat16() * 0.1
    x = torch.randn(batch, k, device="cuda", generator=g).bfloat16()
    q, scale = fp8.quantize_per_channel(weight)
    assert fp8.scaled_mm_refusal(x, q) == "", "these shapes take cuBLASLt"
    got = fp8.fp8_linear(x, q, scale, bias)
    xq, x_scale = fp8.quantize_per_token(x)
    want = fp8.emulated_fp8_mm(xq, x_scale, q, scale, bias, torch.bfloat16)
    assert got.dtype == torch.bfloat16 and got.shape == (batch, n)
    # The same float8 operands: only the fp32 accumulation order and the bf16 rounding differ.
    torch.testing.assert_close(got.float(), want.float(), rtol=1.6e-2, atol=1e-2 * want.abs().max().item())
    exact = x.float() @ weight.float().t() + bias.float()
    err = (got.float() - exact).norm() / exact.norm()
    assert err < 0.06, f"{layer} at batch {batch}: {err:.3f} relative error against bf16"


@pytest.mark.parametrize("fast_accum", [True, False])
@pytest.mark.parametrize("n,k", [(4096, 14336), (28672, 4096)])  # Llama-8B's down_proj and gate_up
def test_prefill_gemms_with_and_without_fast_accumulation_agree_with_the_emulated_path(n, k, fast_accum, monkeypatch):
    """Above TRITON_MAX_TOKENS the GEMM is torch._scaled_mm, with use_fast_accum (fp8.FP8_FAST_ACCUM,
    the default) or not: the same float8 operands as the fp32 reference, the partial sums promoted
    less often. At Llama-8B's longest K both stay within the bound the promoted sums meet."""
    monkeypatch.setattr(fp8, "FP8_FAST_ACCUM", fast_accum)
    g = torch.Generator(device="cuda").manual_seed(1)
    weight = torch.randn(n, k, device="cuda", generator=g).bfloat16() * 0.02
    x = torch.randn(512, k, device="cuda", generator=g).bfloat16()
    q, scale = fp8.quantize_per_channel(weight)
    got = fp8.fp8_linear(x, q, scale, None)
    xq, x_scale = fp8.quantize_per_token(x)
    want = fp8.emulated_fp8_mm(xq, x_scale, q, scale, None, torch.float32)
    err = (got.float() - want).norm() / want.norm()
    print(f"N {n} K {k} fast accumulation {fast_accum}: relative error {err:.2e} against fp32 sums")
    assert err < 5e-3, err
    torch.testing.assert_close(got.float(), want, rtol=1.6e-2, atol=1e-2 * want.abs().max().item())


@pytest.mark.parametrize("batch", [1, 64, 200])
@pytest.mark.parametrize("layer", LLAMA_1B)
def test_the_triton_gemm_agrees_with_the_emulated_path(layer, batch):
    from pdserve.common.engine.models import fp8_kernels

    n, k = LLAMA_1B[layer]
    g = torch.Generator(device="cuda").manual_seed(1)
    weight = torch.randn(n, k, device="cuda", generator=g).bfloat16() * 0.02
    bias = torch.randn(n, device="cuda", generator=g).bfloat16() * 0.1
    x = torch.randn(batch, k, device="cuda", generator=g).bfloat16()
    q, scale = fp8.quantize_per_channel(weight)
    xq, x_scale = fp8.quantize_per_token(x)
    got = fp8_kernels.fp8_gemm(xq, x_scale, q, scale, bias, torch.bfloat16)
    want = fp8.emulated_fp8_mm(xq, x_scale, q, scale, bias, torch.bfloat16)
    assert got.dtype == torch.bfloat16 and got.shape == (batch, n)
    torch.testing.assert_close(got.float(), want.float(), rtol=1.6e-2, atol=1e-2 * want.abs().max().item())


LLAMA_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


@pytest.mark.parametrize("batch", [1, 64, 100, 128])
@pytest.mark.parametrize("layer", LLAMA_8B)
def test_the_tma_gemm_is_bitwise_the_pointer_gemm(layer, batch):
    """fp8_gemm's two kernels at gemm_config's TMA tiles: the same sums in the same order."""
    from pdserve.common.engine.models import fp8_kernels

    n, k = LLAMA_8B[layer]
    g = torch.Generator(device="cuda").manual_seed(3)
    q, scale = fp8.quantize_per_channel(torch.randn(n, k, device="cuda", generator=g).bfloat16() * 0.02)
    xq, x_scale = fp8.quantize_per_token(torch.randn(batch, k, device="cuda", generator=g).bfloat16())
    assert fp8_kernels.tma_describable(xq, q)
    tiles = fp8_kernels.gemm_config(batch, n, k, tma=True)
    got = fp8_kernels.fp8_gemm(xq, x_scale, q, scale, None, torch.bfloat16)
    want = fp8_kernels.fp8_gemm(xq, x_scale, q, scale, None, torch.bfloat16, tiles, tma=False)
    assert torch.equal(got, want)


@pytest.mark.parametrize("batch", [1, 64, 128])
def test_the_fused_gate_up_is_bitwise_the_gemm_then_silu_and_multiply(batch):
    """gate_up_silu_fp8 at Llama-8B's gate_up: fp8_gemm then silu_mul_fp8's float8 rows and scales."""
    from pdserve.common.engine.models import fp8_kernels

    g = torch.Generator(device="cuda").manual_seed(4)
    q, scale = fp8.quantize_per_channel(torch.randn(28672, 4096, device="cuda", generator=g).bfloat16() * 0.02)
    xq, x_scale = fp8.quantize_per_token(torch.randn(batch, 4096, device="cuda", generator=g).bfloat16() * 3)
    want = fp8_kernels.silu_mul_fp8(fp8_kernels.fp8_gemm(xq, x_scale, q, scale, None, torch.bfloat16), fp8.MIN_AMAX)
    got = fp8_kernels.gate_up_silu_fp8(xq, x_scale, q, scale, torch.bfloat16, fp8.MIN_AMAX)
    assert torch.equal(got[1], want[1]) and torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))


def test_unaligned_or_non_bf16_layers_fall_back_to_the_emulated_path():
    x = torch.randn(4, 40, device="cuda").bfloat16()
    q, _ = fp8.quantize_per_channel(torch.randn(24, 40, device="cuda"))
    assert "multiples of 16" in fp8.scaled_mm_refusal(x, q)
    q, scale = fp8.quantize_per_channel(torch.randn(32, 48, device="cuda"))
    assert "bfloat16" in fp8.scaled_mm_refusal(torch.randn(4, 48, device="cuda"), q)
    out = fp8.fp8_linear(torch.randn(4, 48, device="cuda"), q, scale, None)
    assert out.dtype == torch.float32 and out.shape == (4, 32)


@pytest.mark.parametrize("triton_max_tokens", [0, 4096])
@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen2"])
def test_fp8_under_cuda_graphs_gives_the_eager_tokens(arch, triton_max_tokens, tiny_models, monkeypatch):
    """With the decode-size GEMM (fp8_kernels.fp8_gemm) off and on for every batch."""
    monkeypatch.setattr(fp8, "TRITON_MAX_TOKENS", triton_max_tokens)
    rng = random.Random(0)
    cases = [[0] + [rng.randrange(5, 512) for _ in range(rng.randrange(1, 90))] for _ in range(24)]
    params = SamplingParams(max_new_tokens=16, temperature=0)
    kw = dict(model_path=tiny_models(arch), device="cuda", dtype="bfloat16", max_total_tokens=16384)
    graphed = Engine(quantization="fp8", **kw)
    model = graphed.runner.model
    merged = model.model.layers[0].self_attn.qkv_proj if arch != "gpt2" else model.transformer.h[0].attn.c_attn
    assert isinstance(merged, fp8.Fp8Linear) and merged.weight.dtype == torch.float8_e4m3fn
    got = [c.output_ids for c in graphed.generate(cases, params)]
    assert graphed.runner.cuda_graphs.replays > 10
    eager = Engine(quantization="fp8", disable_cuda_graph=True, prefill_cuda_graph_max_tokens=0, **kw)
    want = [c.output_ids for c in eager.generate(cases, params)]
    assert got == want
    unquantized = [c.output_ids for c in Engine(**kw).generate(cases, params)]
    assert unquantized != got, "FP8 gave bf16's tokens exactly: was it quantized?"
    assert graphed.is_idle() and eager.is_idle()


def float8_steps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many representable float8_e4m3fn values lie between a and b, elementwise (same-sign
    values: the bit patterns are ordered like the magnitudes)."""
    return (a.view(torch.uint8).int() - b.view(torch.uint8).int()).abs()


@pytest.mark.parametrize("width", [64, 2048, 4096, 14336])
def test_the_fused_fp8_inputs_are_the_op_then_the_quantization(width):
    """rmsnorm_fp8 / silu_mul_fp8 write the float8 row and scale that triton_ops' op followed by
    quantize_per_token would: silu_mul's bit for bit; rmsnorm's up to the order of its sum of squares
    (one float8 step on a few values at most)."""
    from pdserve.common.engine.models import fp8_kernels, triton_ops

    g = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(70, width, device="cuda", generator=g).bfloat16() * 3
    x[5] = 0.0  # a padded row
    weight = torch.rand(width, device="cuda", generator=g).bfloat16() + 0.5
    for residual in (None, torch.randn(70, width, device="cuda", generator=g).bfloat16()):
        want_res = None if residual is None else residual.clone()
        got_res = None if residual is None else residual.clone()
        want = fp8_kernels.quantize_per_token(triton_ops.rmsnorm(x, weight, 1e-5, want_res), fp8.MIN_AMAX)
        got = fp8_kernels.rmsnorm_fp8(x, weight, 1e-5, got_res, fp8.MIN_AMAX)
        torch.testing.assert_close(got[1], want[1], rtol=2e-7, atol=0)
        steps = float8_steps_apart(got[0], want[0])
        print(f"width {width}, residual {residual is not None}: {int((steps > 0).sum())} of {steps.numel()} apart")
        assert steps.max() <= 1 and (steps > 0).float().mean() < 1e-3
        assert residual is None or torch.equal(got_res, want_res)
    gate_up = torch.randn(70, 2 * width, device="cuda", generator=g).bfloat16() * 4
    want = fp8_kernels.quantize_per_token(triton_ops.silu_mul(gate_up), fp8.MIN_AMAX)
    got = fp8_kernels.silu_mul_fp8(gate_up, fp8.MIN_AMAX)
    assert torch.equal(got[1], want[1]) and torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))


def test_the_fused_fp8_inputs_change_no_token(tiny_models):
    """A Llama served FP8 with its norms and silu-and-multiply writing float8 against the same engine
    with them writing bf16 (quantized by each layer): the same tokens and logprobs (this tiny model's
    rows are 64 wide: its norms reduce in the same order either way)."""
    rng = random.Random(4)
    cases = [[0] + [rng.randrange(5, 512) for _ in range(rng.randrange(1, 90))] for _ in range(16)]
    params = SamplingParams(max_new_tokens=12, temperature=0, logprobs=0)
    kw = dict(model_path=tiny_models("llama"), device="cuda", dtype="bfloat16", max_total_tokens=16384,
              quantization="fp8", disable_cuda_graph=True, prefill_cuda_graph_max_tokens=0)  # fmt: skip
    fused, unfused = Engine(**kw), Engine(**kw)
    layers = unfused.runner.model.model.layers
    assert all(la.input_layernorm.fp8_out and la.post_attention_layernorm.fp8_out and la.mlp.fp8_down for la in layers)
    for layer in layers:
        layer.input_layernorm.fp8_out = layer.post_attention_layernorm.fp8_out = layer.mlp.fp8_down = False
    got, want = fused.generate(cases, params), unfused.generate(cases, params)
    assert [c.output_ids for c in got] == [c.output_ids for c in want]
    assert [[lp.logprob for lp in c.logprobs] for c in got] == [[lp.logprob for lp in c.logprobs] for c in want]
