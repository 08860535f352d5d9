"""Triton kernels: write this forward's new K and V into the paged pool, both in one launch.

    store_kv(k_buf, v_buf, loc, k, v)       K and V into the pool at `loc`
    rope_store_kv(q, k, v, positions, inv_freq, k_buf, v_buf, loc)
                                            neox rotary on q and k in place, then the store above;
                                            bitwise rope_ + store_kv, in one launch (fused Llama path)

NOTE: import this module lazily (never from common/engine/attention/__init__.py): Triton reads
TRITON_INTERPRET when a @triton.jit function is defined, and the CPU tests set it in conftest.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from pdserve.common.engine import pdl
from pdserve.common.engine.models.triton_ops import _rope_cos_sin, _rotate_q_heads, _rotate_store

# A program copies BLOCK_H heads x BLOCK_D dims of one token's K and V; about 4k elements is a
# few 16-byte vectors per thread and keeps wide models (64 KV heads x 128) from spilling.
_MAX_TILE = 4096
# rope_store_kv splits a token's heads over programs up to this many tokens.
_FEW_TOKENS = 256


@triton.jit
def to_pool(x, scale_ptr, buf, QUANTIZE: tl.constexpr):
    """A K or V tile as the pool stores it: cast, or (float8 pool) x / scale in fp32, clamped to
    +-448 and rounded to float8 (kv_pool.quantize_kv's numbers, bit for bit)."""
    if QUANTIZE:
        x = _round_to_e4m3(tl.minimum(tl.maximum(x.to(tl.float32) / tl.load(scale_ptr), -448.0), 448.0))
    return x.to(buf.dtype.element_ty)


@triton.jit
def _round_to_e4m3(x):
    """fp32 x (|x| <= 448) rounded to the nearest e4m3 value (ties to even), still in fp32, so the
    cast after it is exact.

    NOTE: Triton 3.6's interpreter (the CPU tests) casts fp32 to float8e4nv without carrying a
    round-up into the exponent (126.9 became 64, not 128: ~10% of values wrong by 2x). Rounding
    here first makes every backend store torch's numbers; on the GPU it is a few integer ops in a
    memory-bound store. Normal range (|x| >= 2^-6): round the fp32 mantissa to 3 bits on its bits
    (the carry goes into the exponent by itself); subnormals: steps of 2^-9 by the magic-number add.
    """
    bits = x.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
    subnormal = (x + 24576.0) - 24576.0  # 1.5 * 2^14: fp32's rounding leaves multiples of 2^-9
    return tl.where(tl.abs(x) >= 0.015625, normal, subnormal)


def kv_scales(k_buf, k_scale, v_scale):
    """(k_scale, v_scale, QUANTIZE) for a launch: a float8 pool needs its layer's scales; any
    other pool passes k_buf as a placeholder that is never read."""
    quantize = k_buf.dtype == torch.float8_e4m3fn
    if quantize:
        assert k_scale is not None and v_scale is not None, "a float8 KV pool needs its layer's scales"
        return k_scale, v_scale, True
    return k_buf, k_buf, False


@triton.jit
def _store_kv_kernel(
    k_buf,
    v_buf,
    loc,
    k,
    v,
    k_scale,
    v_scale,
    stride_buf_s,
    stride_buf_h,
    stride_k_t,
    stride_k_h,
    stride_v_t,
    stride_v_h,
    num_kv_heads,
    head_dim,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    QUANTIZE: tl.constexpr,
):
    token = tl.program_id(0)
    head_block = tl.program_id(1)
    # int64: slot * stride overflows int32 on pools past 2^31 elements.
    slot = tl.load(loc + token).to(tl.int64)

    offs_h = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h < num_kv_heads)[:, None] & (offs_d < head_dim)[None, :]
    # int64 heads too (a pool's strides are its to choose).
    dst = slot * stride_buf_s + offs_h[:, None].to(tl.int64) * stride_buf_h + offs_d[None, :]

    k_row = tl.load(k + token.to(tl.int64) * stride_k_t + offs_h[:, None] * stride_k_h + offs_d[None, :], mask=mask)
    tl.store(k_buf + dst, to_pool(k_row, k_scale, k_buf, QUANTIZE), mask=mask)
    v_row = tl.load(v + token.to(tl.int64) * stride_v_t + offs_h[:, None] * stride_v_h + offs_d[None, :], mask=mask)
    tl.store(v_buf + dst, to_pool(v_row, v_scale, v_buf, QUANTIZE), mask=mask)


def store_kv(k_buf, v_buf, loc, k, v, k_scale=None, v_scale=None) -> None:
    """k_buf, v_buf: [S, KVH, D] (pool dtype); loc: [T] int64 slot per token; k, v: [T, KVH, D] any
    float dtype, cast to the pool dtype. One launch writes both K and V. T may be 0 (then do nothing).
    A float8 pool needs k_scale, v_scale ([1] fp32 device tensors, the layer's): k / k_scale is stored.

    k and v may be strided views (e.g. slices of a fused qkv projection) as long as the last dim is
    contiguous. Slots in `loc` must be distinct, except that padded tokens may all write slot 0.
    """
    num_tokens = loc.shape[0]
    if num_tokens == 0:
        return
    _, num_kv_heads, head_dim = k_buf.shape
    assert k.shape == v.shape == (num_tokens, num_kv_heads, head_dim), (k.shape, v.shape, k_buf.shape)
    assert v_buf.shape == k_buf.shape and v_buf.stride() == k_buf.stride()
    assert k_buf.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1

    block_d = triton.next_power_of_2(head_dim)
    block_h = min(triton.next_power_of_2(num_kv_heads), max(1, _MAX_TILE // block_d))
    grid = (num_tokens, triton.cdiv(num_kv_heads, block_h))
    k_scale, v_scale, quantize = kv_scales(k_buf, k_scale, v_scale)
    _store_kv_kernel[grid](
        k_buf,
        v_buf,
        loc,
        k,
        v,
        k_scale,
        v_scale,
        k_buf.stride(0),
        k_buf.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        num_kv_heads,
        head_dim,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        QUANTIZE=quantize,
        num_warps=4 if block_h * block_d >= 1024 else 1,
    )


@triton.jit
def _rope_store_kv_kernel(
    q,
    k,
    v,
    positions,
    inv_freq,
    k_buf,
    v_buf,
    loc,
    k_scale,
    v_scale,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_buf_s,
    stride_buf_h,
    q_heads_per_group,
    kv_heads_per_group,
    half,
    BLOCK_HALF: tl.constexpr,
    BLOCK_QH: tl.constexpr,
    BLOCK_KH: tl.constexpr,
    QUANTIZE: tl.constexpr,
    PDL: tl.constexpr,
):
    # One program per token and head group (grid axis 1: a group's query heads and the KV heads
    # they read): rope_'s math (the same helpers), then store_kv's writes.
    token = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    offs = tl.arange(0, BLOCK_HALF)
    mask_d = offs < half
    # The token's cos and sin and its slot come from the forward's inputs, which no kernel of the
    # forward writes: made before the wait (common/engine/pdl.py), while the qkv GEMM may still run.
    cos, sin = _rope_cos_sin(positions, inv_freq, token, offs, mask_d, q.dtype.element_ty)
    # int64: slot * stride overflows int32 on pools past 2^31 elements.
    slot = tl.load(loc + token, cache_modifier=".cg").to(tl.int64)
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    _rotate_q_heads(
        q, token, stride_qt, stride_qh, group * q_heads_per_group, q_heads_per_group, half, offs, mask_d, cos, sin,
        BLOCK_QH,
    )  # fmt: skip

    kv_heads = group * kv_heads_per_group + tl.arange(0, BLOCK_KH)
    kv_mask = (kv_heads < (group + 1) * kv_heads_per_group)[:, None] & mask_d[None, :]
    # k too is rotated in place, so after this call k holds what rope_ would have left there.
    k1, k2 = _rotate_store(
        k + token * stride_kt + kv_heads[:, None] * stride_kh + offs[None, :], cos, sin, half, kv_mask
    )
    dst = slot * stride_buf_s + kv_heads[:, None].to(tl.int64) * stride_buf_h + offs[None, :]
    tl.store(k_buf + dst, to_pool(k1, k_scale, k_buf, QUANTIZE), mask=kv_mask)
    tl.store(k_buf + dst + half, to_pool(k2, k_scale, k_buf, QUANTIZE), mask=kv_mask)
    v_ptr = v + token * stride_vt + kv_heads[:, None] * stride_vh + offs[None, :]
    tl.store(v_buf + dst, to_pool(tl.load(v_ptr, mask=kv_mask), v_scale, v_buf, QUANTIZE), mask=kv_mask)
    tl.store(v_buf + dst + half, to_pool(tl.load(v_ptr + half, mask=kv_mask), v_scale, v_buf, QUANTIZE), mask=kv_mask)


def rope_store_kv(q, k, v, positions, inv_freq, k_buf, v_buf, loc, k_scale=None, v_scale=None) -> None:
    """`rope_(q, k, positions, inv_freq)` then `store_kv(k_buf, v_buf, loc, k, v)` in one launch,
    with the same results bit for bit: q [T, H, D] and k [T, KVH, D] are rotated in place (neox,
    inv_freq [D/2] float32, no partial rotary), and the rotated k and v written at `loc`.

    Same rules as those two: strided views (of a fused qkv) with a contiguous last dim; distinct
    slots except for padded tokens, which may all write slot 0; T may be 0; a float8 pool needs
    its layer's k_scale and v_scale.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    half = inv_freq.numel()
    assert 2 * half == head_dim, "partial rotary is not supported"
    if num_tokens == 0:
        return
    _, num_kv_heads, _ = k_buf.shape
    assert k.shape == v.shape == (num_tokens, num_kv_heads, head_dim) == (loc.shape[0], *k_buf.shape[1:])
    assert v_buf.shape == k_buf.shape and v_buf.stride() == k_buf.stride() and k.dtype == q.dtype
    assert q.stride(2) == k.stride(2) == v.stride(2) == k_buf.stride(2) == 1
    k_scale, v_scale, quantize = kv_scales(k_buf, k_scale, v_scale)
    # Few tokens (a decode step): a program per KV head group, else too few programs to fill the GPU
    # (Llama-8B, batch 64: 64 programs of 32 + 8 heads took 6.8 us a layer, H100).
    groups = num_kv_heads if num_tokens <= _FEW_TOKENS and num_q_heads % num_kv_heads == 0 else 1
    q_per_group, kv_per_group = num_q_heads // groups, num_kv_heads // groups
    _rope_store_kv_kernel[(num_tokens, groups)](
        q,
        k,
        v,
        positions,
        inv_freq,
        k_buf,
        v_buf,
        loc,
        k_scale,
        v_scale,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_buf.stride(0),
        k_buf.stride(1),
        q_per_group,
        kv_per_group,
        half,
        BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_QH=triton.next_power_of_2(q_per_group),
        BLOCK_KH=triton.next_power_of_2(kv_per_group),
        QUANTIZE=quantize,
        PDL=pdl.enabled(q.device),
        launch_pdl=pdl.enabled(q.device),
        num_warps=4 if groups == 1 else 1,
    )
