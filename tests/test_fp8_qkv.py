"""fp8_qkv.qkv_rope_store (models/fp8_qkv.py) against the two launches it fuses, fp8_gemm then
rope_store_kv: bitwise the same q/k/v output and pool (the interpreter on CPU; compiled on a GPU),
and the permuted layer's other paths giving the merged layer's output."""

import pytest
import torch
from torch import nn

from pdserve.common.engine.attention.triton_store import rope_store_kv
from pdserve.common.engine.kv_pool import quantize_kv
from pdserve.common.engine.models import fp8
from pdserve.common.engine.models.layers import merge_linears, rope_inv_freq

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The interpreter mishandles bf16 in rotary (tests/test_rope_store.py); a GPU checks it too.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
POOL = 48


def qkv_layer(heads, kv_heads, head_dim, hidden, bias, dtype, seed):
    """A merged FP8 q/k/v layer, as SelfAttention.fuse makes it from three quantized projections."""
    torch.manual_seed(seed)
    parts = []
    for rows in (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim):
        linear = nn.Linear(hidden, rows, bias=bias)
        nn.init.normal_(linear.weight, std=0.5)
        parts.append(fp8.Fp8Linear.quantize(linear.to(dtype)))
    return merge_linears(*parts).to(DEVICE)


def pools(kv_heads, head_dim, dtype, gen):
    k_buf = torch.randn(POOL, kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    v_buf = torch.randn(POOL, kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    return k_buf, v_buf


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 64), (2, 1, 128), (3, 3, 64)])
@pytest.mark.parametrize("tokens", [1, 5, 19])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("float8_pool", [False, True])
def test_the_fused_qkv_is_bitwise_the_gemm_then_rope_store(heads, kv_heads, head_dim, tokens, dtype, float8_pool):
    from pdserve.common.engine.models import fp8_kernels, fp8_qkv

    hidden, bias = 96, heads == 3  # (3, 3, 64): Qwen2's q/k/v bias
    gen = torch.Generator().manual_seed(tokens)
    layer = qkv_layer(heads, kv_heads, head_dim, hidden, bias, dtype, seed=tokens + head_dim)
    xq, x_scale = fp8.quantize_per_token((3 * torch.randn(tokens, hidden, generator=gen)).to(DEVICE, dtype))
    positions = torch.randint(0, 5000, (tokens,), generator=gen).to(DEVICE)
    inv_freq = rope_inv_freq(head_dim, {"rope_theta": 500000.0}).to(DEVICE)
    loc = torch.randperm(POOL, generator=gen)[:tokens].to(DEVICE)
    k_buf, v_buf = pools(kv_heads, head_dim, dtype, gen)
    scales = ()
    if float8_pool:
        k_buf, v_buf = quantize_kv(k_buf, torch.tensor(2.0)), quantize_kv(v_buf, torch.tensor(2.0))
        scales = (torch.tensor([0.05], device=DEVICE), torch.tensor([0.07], device=DEVICE))

    want_out = fp8_kernels.fp8_gemm(xq, x_scale, layer.weight, layer.weight_scale, layer.bias, dtype)
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    q, k, v = (t.view(tokens, -1, head_dim) for t in want_out.split([q_size, kv_size, kv_size], dim=-1))
    want_k, want_v = k_buf.clone(), v_buf.clone()
    rope_store_kv(q, k, v, positions, inv_freq, want_k, want_v, loc, *scales)

    fp8_qkv.permute_for_rope(layer, head_dim)
    assert fp8_qkv.runs(xq, layer)
    got = fp8_qkv.qkv_rope_store(xq, x_scale, layer, dtype, positions, inv_freq, heads, kv_heads, k_buf, v_buf, loc,
                                 *scales)  # fmt: skip
    assert torch.equal(got, want_out)  # q and k rotated in it, as rope_store_kv leaves them
    assert torch.equal(k_buf.view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(v_buf.view(torch.uint8), want_v.view(torch.uint8))


def test_each_tile_holds_its_dims_and_their_rotary_partners():
    from pdserve.common.engine.models.fp8_qkv import rope_tile_order

    order = rope_tile_order(heads=3, head_dim=128)
    assert sorted(order.tolist()) == list(range(3 * 128))
    for tile in order.view(-1, 64):
        assert len({int(row) // 128 for row in tile}) == 1  # one head
        assert torch.equal(tile[32:] - tile[:32], torch.full((32,), 64))  # dim d, then d + head_dim / 2
    assert torch.equal(rope_tile_order(heads=2, head_dim=64), torch.arange(128))  # a tile is a head
    with pytest.raises(ValueError, match="multiple of 64"):
        rope_tile_order(heads=2, head_dim=96)


@pytest.mark.parametrize("tokens", [3, 200])
def test_a_permuted_layer_gives_the_merged_layers_output_on_its_other_paths(tokens):
    """Prefill past TRITON_MAX_TOKENS (and the CPU's emulated GEMM) run the permuted rows through
    fp8_linear: Fp8Linear.forward puts the columns back."""
    from pdserve.common.engine.models import fp8_qkv

    layer = qkv_layer(4, 2, 128, 64, True, torch.float32, seed=1)
    x = torch.randn(tokens, 64, device=DEVICE)
    want = layer(x)
    fp8_qkv.permute_for_rope(layer, 128)
    assert not torch.equal(fp8.fp8_linear(x, layer.weight, layer.weight_scale, layer.bias), want)
    assert torch.equal(layer(x), want)


def test_an_engine_on_the_fused_qkv_gives_the_tokens_of_the_gemm_then_rope_store(tmp_path, monkeypatch):
    """The wiring (positions, slots, the layer's pool, prefill and decode) through a CPU engine on the
    fused model path, interpreted: the same greedy tokens as the same engine without the kernel."""
    from pdserve.common.engine.engine import Engine
    from pdserve.common.engine.models import fp8_qkv, llama
    from pdserve.common.tiny_model import make_tiny_model
    from pdserve.common.types import SamplingParams

    model = str(make_tiny_model(tmp_path / "llama", "llama", overrides={"head_dim": 128}))
    prompts = [[0, 5, 9, 13, 200, 7, 7], [0, 44, 3]]
    params = SamplingParams(max_new_tokens=3, temperature=0)
    calls = []
    run = fp8_qkv.qkv_rope_store
    monkeypatch.setattr(fp8_qkv, "qkv_rope_store", lambda *a, **k: (calls.append(a[0].shape[0]), run(*a, **k))[1])

    def tokens():
        engine = Engine(model_path=model, device="cpu", quantization="fp8", attention_backend="triton", page_size=4,
                        max_total_tokens=1024)  # fmt: skip
        engine.runner.model.fuse()
        out = [c.output_ids for c in engine.generate(prompts, params)]
        assert engine.is_idle()
        return out

    fused = tokens()
    assert sorted(set(calls)) == [2, 10], calls  # a prefill of both prompts, then decode steps of both
    monkeypatch.setattr(llama, "fp8_qkv_fits", lambda *a: False)
    calls.clear()
    assert tokens() == fused and not calls
