"""Block-wise FP8 on CUDA (common/engine/models/fp8_block_kernels.py): the per-token-group
quantization bitwise the torch ops in bf16, the block-scaled Triton GEMM against the reference at
Llama-8B's and SmolLM2's shapes, decode and prefill sizes, and block-wise checkpoints served in bf16
giving the same greedy tokens replayed from CUDA graphs as run eagerly."""

import random

import pytest
import torch

from pdserve.bench.micro.fp8_checkpoints import WIDE, write_block_checkpoints
from pdserve.common.engine.engine import Engine
from pdserve.common.engine.models import fp8, fp8_block
from pdserve.common.tiny_model import make_tiny_model
from pdserve.common.types import SamplingParams

if torch.cuda.get_device_capability() < (8, 9):
    pytest.skip("FP8 GEMMs need compute capability 8.9+", allow_module_level=True)

# (N, K) as the fused CUDA path runs them: Llama-8B (hidden 4096, MLP 14336, 8 KV heads of 128) and
# SmolLM2-135M (hidden 576 = 4.5 tiles of 128, 3 KV heads of 64: qkv 960 rows, not whole tiles).
SHAPES = {
    "8b qkv": (6144, 4096),
    "8b o": (4096, 4096),
    "8b gate_up": (28672, 4096),
    "8b down": (4096, 14336),
    "smollm2 qkv": (960, 576),
    "smollm2 down": (576, 1536),
}


@pytest.mark.parametrize("width", [576, 4096, 14336])
def test_the_triton_group_quantization_is_bitwise_the_torch_ops_in_bf16(width):
    from pdserve.common.engine.models import fp8_block_kernels

    x = torch.randn(130, 2 * width, device="cuda").bfloat16()[:, ::2]  # strided, as a view may be
    x = x * torch.logspace(-4, 4, 130, device="cuda").bfloat16()[:, None]
    x[7] = 0.0  # a padded row
    got_q, got_scale = fp8_block_kernels.quantize_per_token_group(x, 128, fp8.MIN_AMAX)
    want_q, want_scale = fp8_block.quantize_per_token_group(x, 128)
    assert torch.equal(got_scale, want_scale)
    assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8))


@pytest.mark.parametrize("tokens", [1, 64, 128, 200, 2048])
@pytest.mark.parametrize("layer", SHAPES)
def test_the_block_gemm_agrees_with_the_reference(layer, tokens):
    """The same float8 operands and scales as the fp32 reference: only the order of the sums (the
    tensor cores' inside a group), and the bf16 output's rounding, differ."""
    n, k = SHAPES[layer]
    g = torch.Generator(device="cuda").manual_seed(0)
    weight = torch.randn(n, k, device="cuda", generator=g).bfloat16() * 0.02
    bias = torch.randn(n, device="cuda", generator=g).bfloat16() * 0.1
    x = torch.randn(tokens, k, device="cuda", generator=g).bfloat16()
    q, scale = fp8_block.quantize_blockwise(weight, (128, 128))
    assert fp8_block.gemm_refusal(x) == ""
    got = fp8_block.block_fp8_linear(x, q, scale, (128, 128), bias)
    xq, x_scale = fp8_block.quantize_per_token_group(x, 128)
    want = fp8_block.emulated_block_fp8_mm(xq, x_scale, q, scale, (128, 128), bias, torch.float32)
    assert got.dtype == torch.bfloat16 and got.shape == (tokens, n)
    err = (got.float() - want).norm() / want.norm()
    assert err < 5e-3, f"{layer} at {tokens} tokens: {err:.2e} relative to the fp32 reference"
    torch.testing.assert_close(got.float(), want, rtol=1.6e-2, atol=1e-2 * want.abs().max().item())
    exact = x.float() @ weight.float().t() + bias.float()
    assert (got.float() - exact).norm() / exact.norm() < 0.06


def test_the_block_gemm_reads_one_scale_row_per_weight_row():
    """A merged layer whose parts end inside a row tile (fp8_block.Fp8BlockLinear.merge: block_n 1)."""
    from torch import nn

    parts = [fp8_block.Fp8BlockLinear.quantize(nn.Linear(576, n).cuda().bfloat16()) for n in (576, 192, 192)]
    merged = fp8_block.Fp8BlockLinear.merge(parts)
    assert merged.block == (1, 128) and merged.weight_scale.shape == (960, 5)
    x = torch.randn(33, 576, device="cuda").bfloat16()
    want = torch.cat([p(x) for p in parts], dim=-1)
    torch.testing.assert_close(merged(x).float(), want.float(), rtol=1.6e-2, atol=1e-2 * want.abs().max().item())


@pytest.fixture(scope="module")
def block_checkpoints(tmp_path_factory):
    """arch -> (block-wise FP8 checkpoint, its float original), the widened tiny models of
    tests/test_fp8_block_checkpoints.py (q 256 rows and k, v 64: the merged qkv has one scale row per row)."""
    root, built = tmp_path_factory.mktemp("block"), {}

    def get(arch: str) -> tuple[str, str]:
        if arch not in built:
            src = make_tiny_model(root / f"{arch}-float", arch, seed=0, overrides=WIDE)
            (root / arch).mkdir()
            built[arch] = write_block_checkpoints(src, root / arch, "fp8 block")[0], str(src)
        return built[arch]

    return get


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_block_checkpoint_under_cuda_graphs_gives_the_eager_tokens(arch, block_checkpoints):
    rng = random.Random(0)
    cases = [[0] + [rng.randrange(5, 512) for _ in range(rng.randrange(1, 90))] for _ in range(24)]
    params = SamplingParams(max_new_tokens=16, temperature=0)
    path, original = block_checkpoints(arch)
    kw = dict(device="cuda", dtype="bfloat16", max_total_tokens=16384)
    graphed = Engine(model_path=path, **kw)
    assert graphed.config.quantization == "fp8-block"
    layer = graphed.runner.model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, fp8_block.Fp8BlockLinear) and layer.self_attn.qkv_proj.block == (1, 128)
    assert isinstance(layer.mlp.gate_up_proj, fp8_block.Fp8BlockLinear)
    got = [c.output_ids for c in graphed.generate(cases, params)]
    assert graphed.runner.cuda_graphs.replays > 10
    eager = Engine(model_path=path, disable_cuda_graph=True, prefill_cuda_graph_max_tokens=0, **kw)
    assert got == [c.output_ids for c in eager.generate(cases, params)]
    unquantized = [c.output_ids for c in Engine(model_path=original, **kw).generate(cases, params)]
    assert unquantized != got, "block FP8 gave bf16's tokens exactly: was it quantized?"
    assert graphed.is_idle() and eager.is_idle()


def test_quantization_fp8_block_under_cuda_graphs_gives_the_eager_tokens(tiny_models):
    """--quantization fp8-block on the tiny Llama (hidden 64: one partial 128-wide group per row)."""
    rng = random.Random(1)
    cases = [[0] + [rng.randrange(5, 512) for _ in range(rng.randrange(1, 90))] for _ in range(24)]
    params = SamplingParams(max_new_tokens=16, temperature=0)
    kw = dict(model_path=tiny_models("llama"), device="cuda", dtype="bfloat16", max_total_tokens=16384,
              quantization="fp8-block")  # fmt: skip
    graphed = Engine(**kw)
    assert isinstance(graphed.runner.model.model.layers[0].mlp.down_proj, fp8_block.Fp8BlockLinear)
    got = [c.output_ids for c in graphed.generate(cases, params)]
    assert graphed.runner.cuda_graphs.replays > 10
    eager = Engine(disable_cuda_graph=True, prefill_cuda_graph_max_tokens=0, **kw)
    assert got == [c.output_ids for c in eager.generate(cases, params)]
    assert graphed.is_idle() and eager.is_idle()
