"""The FP8 KV cache's pieces, exactly: the Triton store kernels quantize bit for bit as the pool's
torch path does, the attention kernels read float8 times the layer's scale (against attention
computed here in fp32 from the dequantized pool), and the scales (calibration, checkpoint) units."""

import pytest
import torch

from pdserve.common.engine.attention.triton_decode import DecodeWorkspace, decode_attention
from pdserve.common.engine.attention.triton_extend import extend_attention
from pdserve.common.engine.attention.triton_store import rope_store_kv, store_kv
from pdserve.common.engine.kv_pool import PagedKVPool, quantize_kv
from pdserve.common.engine.kv_scales import (
    CALIBRATION_MARGIN,
    CALIBRATION_TOKENS,
    calibrate_kv_scales,
    calibration_ids,
    checkpoint_kv_scales,
)

FP8 = torch.float8_e4m3fn
KV_HEADS, HEADS, DIM, TOKENS = 2, 4, 32, 40
PREFIX = 24  # of TOKENS: the extend test's cached prefix (not a multiple of the kernel's key block)


def fp8_pool() -> PagedKVPool:
    pool = PagedKVPool(5, 16, 1, KV_HEADS, DIM, FP8, "cpu")
    pool.set_scales(torch.tensor([0.05]), torch.tensor([0.02]))
    return pool


def kv(seed=0):
    g = torch.Generator().manual_seed(seed)
    # Wide enough to reach saturation (|k| / 0.05 > 448) and float8's subnormals.
    return torch.randn(TOKENS, KV_HEADS, DIM, generator=g) * 8, torch.randn(TOKENS, KV_HEADS, DIM, generator=g)


def test_the_store_kernels_quantize_bit_for_bit_as_torch():
    """Including the round-ups that carry into the exponent, which Triton's interpreter gets wrong
    on its own (triton_store._round_to_e4m3)."""
    k, v = kv()
    loc = torch.arange(16, 16 + TOKENS)
    pool = fp8_pool()
    store_kv(pool.k_buffers[0], pool.v_buffers[0], loc, k, v, *pool.layer_scales(0))
    expected = fp8_pool()
    expected.set_kv(0, loc, k, v)
    for ours, theirs in ((pool.k_storage[0], expected.k_storage[0]), (pool.v_storage[0], expected.v_storage[0])):
        assert torch.equal(ours.view(torch.uint8), theirs.view(torch.uint8))
    assert (k.abs() / 0.05 > 448).any()  # saturation was exercised

    q = torch.randn(TOKENS, HEADS, DIM)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, DIM, 2).float() / DIM))
    rotated = fp8_pool()
    k_rot = k.clone()
    rope_store_kv(
        q,
        k_rot,
        v,
        torch.arange(TOKENS),
        inv_freq,
        rotated.k_buffers[0],
        rotated.v_buffers[0],
        loc,
        *rotated.layer_scales(0),
    )
    assert torch.equal(
        rotated.k_buffers[0][loc].view(torch.uint8), quantize_kv(k_rot, rotated.k_scales[0]).view(torch.uint8)
    )
    with pytest.raises(AssertionError, match="scales"):
        store_kv(pool.k_buffers[0], pool.v_buffers[0], loc, k, v)


def attention(q, keys, values, scale, window=None):
    """Causal attention of the last len(q) positions over [S, KVH, D] keys and values, in fp32
    (with a sliding window: only keys less than `window` positions back)."""
    group = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    scores = torch.einsum("thd,shd->hts", q, keys) * scale
    n, e = keys.shape[0], q.shape[0]
    distance = torch.arange(n - e, n)[:, None] - torch.arange(n)[None]
    hidden = (distance < 0) | (distance >= window) if window else distance < 0
    scores = scores.masked_fill(hidden, float("-inf"))
    return torch.einsum("hts,shd->thd", scores.softmax(-1), values)


@pytest.mark.parametrize("splits", [1, 2])
def test_decode_and_extend_read_float8_times_the_layer_scale(splits):
    k, v = kv(1)
    slots = torch.arange(16, 16 + TOKENS)
    pool = fp8_pool()
    pool.set_kv(0, slots[:-1], k[:-1], v[:-1])  # the last token is the decode step's own
    r2t = torch.zeros(2, 64, dtype=torch.int32)
    r2t[0, :TOKENS] = slots.int()
    q = torch.randn(TOKENS, HEADS, DIM)
    k_buf, v_buf, (k_scale, v_scale) = pool.k_buffers[0], pool.v_buffers[0], pool.layer_scales(0)

    out = torch.empty(1, HEADS, DIM)
    row, length = torch.tensor([0]), torch.tensor([TOKENS])
    work = DecodeWorkspace(2, HEADS, DIM, 2, "cpu")
    new = (k[-1:], v[-1:], slots[-1:])  # stored by the decode launch itself, quantized
    decode_attention(q[-1:], k_buf, v_buf, out, r2t, row, length, 0.2, None, splits, work, *new, k_scale, v_scale)
    keys, values = pool.read_kv(0, slots, torch.float32)
    assert torch.equal(pool.k_buffers[0][slots[-1:]].view(torch.uint8), quantize_kv(k[-1:], 0.05).view(torch.uint8))
    torch.testing.assert_close(out, attention(q[-1:], keys, values, 0.2), atol=3e-5, rtol=1e-4)

    # Extend: the first PREFIX tokens cached (read through float8), the rest new, read as computed.
    new = TOKENS - PREFIX
    pool.set_kv(0, slots, k, v)
    keys, values = pool.read_kv(0, slots, torch.float32)
    keys[PREFIX:], values[PREFIX:] = k[PREFIX:], v[PREFIX:]
    out = torch.empty(new, HEADS, DIM)
    lens = torch.tensor([TOKENS], dtype=torch.int32), torch.tensor([new], dtype=torch.int32)
    zero = torch.tensor([0], dtype=torch.int32)
    extend_attention(
        q[PREFIX:], k_buf, v_buf, out, r2t, row, *lens, zero, new, 0.2, None, k_scale, v_scale, k[PREFIX:], v[PREFIX:]
    )
    torch.testing.assert_close(out, attention(q[PREFIX:], keys, values, 0.2), atol=3e-5, rtol=1e-4)
    # (the prefix did go through float8: read as computed, it gives another output)
    assert not torch.allclose(out, attention(q[PREFIX:], k, v, 0.2), atol=1e-3, rtol=1e-3)
    with pytest.raises(AssertionError, match="own K and V"):
        extend_attention(q[PREFIX:], k_buf, v_buf, out, r2t, row, *lens, zero, new, 0.2, None, k_scale, v_scale)


class Tokenizer:
    def __init__(self, ids):
        self.ids = ids

    def __call__(self, text):
        if self.ids is None:
            raise ValueError("cannot encode")
        return {"input_ids": self.ids}


def test_calibration_ids_fall_back_to_fixed_random_tokens():
    text = calibration_ids(Tokenizer(list(range(1000))), vocab_size=2000)
    assert text == list(range(CALIBRATION_TOKENS))
    for broken in (None, Tokenizer(None), Tokenizer([1, 2, 3])):
        ids = calibration_ids(broken, vocab_size=300)
        assert len(ids) == CALIBRATION_TOKENS and ids == calibration_ids(None, vocab_size=300)
        assert max(ids) < 300 and len(set(ids)) > 100


def test_calibrated_scales_are_the_layers_amax_over_448_times_the_margin(tiny_models):
    from pdserve.common.engine.models.loader import load_model

    model = load_model(tiny_models("llama"), torch.float32, torch.device("cpu"))
    ids = calibration_ids(None, model.arch.vocab_size)[:100]
    k_scales, v_scales = calibrate_kv_scales(model, ids, torch.float32, "cpu")
    assert torch.equal(k_scales, calibrate_kv_scales(model, ids, torch.float32, "cpu")[0])  # deterministic
    captured = {}

    def keep(layer, loc, k, v):
        captured[layer] = (k.abs().amax(), v.abs().amax())

    original = PagedKVPool.set_kv
    try:
        PagedKVPool.set_kv = lambda self, layer, loc, k, v: (keep(layer, loc, k, v), original(self, layer, loc, k, v))
        calibrate_kv_scales(model, ids, torch.float32, "cpu")
    finally:
        PagedKVPool.set_kv = original
    for layer, (k_amax, v_amax) in captured.items():
        assert k_scales[layer] == pytest.approx(float(k_amax) / 448 * CALIBRATION_MARGIN)
        assert v_scales[layer] == pytest.approx(float(v_amax) / 448 * CALIBRATION_MARGIN)


class Tensors:
    def __init__(self, tensors):
        self.tensors = tensors

    def keys(self):
        return self.tensors.keys()

    def get_tensor(self, key):
        return self.tensors[key]


def test_checkpoint_scales_by_layer_and_their_refusals():
    names = {"model.layers.1.self_attn.k_scale": 0.5, "model.layers.0.self_attn.k_proj.output_scale": 0.25}
    names |= {"model.layers.0.self_attn.v_scale": 2.0, "model.layers.1.self_attn.v_proj.output_scale": 4.0}
    tensors = {key: torch.tensor(value) for key, value in names.items()}
    tensors["model.layers.0.mlp.up_proj.weight"] = torch.ones(2, 2)
    k, v = checkpoint_kv_scales([("a", Tensors(tensors))], num_layers=2)
    assert k.tolist() == [0.25, 0.5] and v.tolist() == [2.0, 4.0]
    assert checkpoint_kv_scales([("a", Tensors({"lm_head.weight": torch.ones(1)}))], 2) is None
    with pytest.raises(ValueError, match="lack k_scale of layer 2"):
        checkpoint_kv_scales([("a", Tensors(tensors))], num_layers=3)
    with pytest.raises(ValueError, match="one positive number"):
        checkpoint_kv_scales([("a", Tensors(tensors | {"model.layers.0.self_attn.v_scale": torch.tensor(0.0)}))], 2)


def test_decode_of_a_bf16_model_reads_float8_in_fp16():
    """A bf16 q over a float8 pool: the products in fp16 (triton_decode.FP8_WIDEN_TO_F16), within
    bf16's rounding of attention computed in fp32. (Only this path on the CPU: Triton 3.6's
    interpreter computes bf16 tl.dot wrongly, ~1e7 off; tests/gpu/test_fp8_kv_cuda.py runs both.)"""
    k, v = kv(2)
    slots = torch.arange(16, 16 + TOKENS)
    pool = fp8_pool()
    pool.set_kv(0, slots, k, v)
    r2t = torch.zeros(2, 64, dtype=torch.int32)
    r2t[0, :TOKENS] = slots.int()
    q = torch.randn(1, HEADS, DIM) * 3
    keys, values = pool.read_kv(0, slots, torch.float32)
    expected = attention(q.bfloat16().float(), keys, values, 0.2)
    out = torch.empty(1, HEADS, DIM, dtype=torch.bfloat16)
    work = DecodeWorkspace(2, HEADS, DIM, 1, "cpu")
    decode_attention(
        q.bfloat16(), pool.k_buffers[0], pool.v_buffers[0], out, r2t, torch.tensor([0]), torch.tensor([TOKENS]), 0.2,
        None, 1, work, k_scale=pool.k_scales[:1], v_scale=pool.v_scales[:1],
    )  # fmt: skip
    error = (out.float() - expected).abs().max().item()
    assert error < 0.02 * expected.abs().max().item(), error


@pytest.mark.parametrize("prefix,new,window", [(0, 130, None), (100, 150, None), (100, 150, 70), (130, 20, 40)])
def test_extend_over_a_float8_prefix_in_every_range(prefix, new, window):
    """Two requests, prefixes read through float8 and new keys as computed, each walked in the
    kernel's three ranges (whole key blocks, the causal diagonal, a sliding window's edge)."""
    total, g = prefix + new, torch.Generator().manual_seed(3)
    pool = PagedKVPool(2 + 2 * total // 16, 16, 1, KV_HEADS, DIM, FP8, "cpu")
    pool.set_scales(torch.tensor([0.05]), torch.tensor([0.02]))
    r2t = torch.zeros(2, total, dtype=torch.int32)
    q, out, expected = torch.randn(2 * new, HEADS, DIM, generator=g), torch.empty(2 * new, HEADS, DIM), []
    k, v = torch.randn(2 * total, KV_HEADS, DIM, generator=g) * 8, torch.randn(2 * total, KV_HEADS, DIM, generator=g)
    k_new, v_new = torch.empty(2 * new, KV_HEADS, DIM), torch.empty(2 * new, KV_HEADS, DIM)
    shuffled = torch.randperm(2 * total, generator=g) + 16  # (page 0 stays reserved)
    for r in range(2):
        slots = shuffled[r * total : (r + 1) * total]
        r2t[r] = slots.int()
        mine = slice(r * total, (r + 1) * total)
        pool.set_kv(0, slots.long(), k[mine], v[mine])
        k_new[r * new : (r + 1) * new], v_new[r * new : (r + 1) * new] = k[mine][prefix:], v[mine][prefix:]
        keys, values = pool.read_kv(0, slots.long(), torch.float32)
        keys[prefix:], values[prefix:] = k[mine][prefix:], v[mine][prefix:]
        expected.append(attention(q[r * new : (r + 1) * new], keys, values, 0.2, window))
    i32 = dict(dtype=torch.int32)
    lens = torch.tensor([total] * 2, **i32), torch.tensor([new] * 2, **i32), torch.tensor([0, new], **i32)
    rows = torch.tensor([1, 0])  # request i reads row 1 - i
    r2t = r2t.flip(0).contiguous()
    extend_attention(q, pool.k_buffers[0], pool.v_buffers[0], out, r2t, rows, *lens, new, 0.2, window,
                     *pool.layer_scales(0), k_new, v_new)  # fmt: skip
    torch.testing.assert_close(out, torch.cat(expected), atol=3e-5, rtol=1e-4)
    if prefix == 0:  # the kernel compiled without the prefix's walk gives the same numbers
        alone = torch.empty_like(out)
        extend_attention(q, pool.k_buffers[0], pool.v_buffers[0], alone, r2t, rows, *lens, new, 0.2, window,
                         *pool.layer_scales(0), k_new, v_new, has_prefix=False)  # fmt: skip
        assert torch.equal(alone, out)
