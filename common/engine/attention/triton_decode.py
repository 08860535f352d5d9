"""Triton kernels: flash-decoding (split-K) paged attention, one new query token per request.

Stage 1, grid (batch, head blocks, kv splits): a program takes one request, the query heads of
one KV head group and one contiguous split of the request's visible KV, and writes a partial
output (already normalised) and its log2-sum-exp into the workspace. It can also store the
step's new K and V first (one launch instead of two). Stage 2, grid (batch,
heads): merges the splits. Splitting the KV keeps the GPU full when the batch is small; with
one split, stage 1 writes the output itself and stage 2 is not launched.

A program serves up to BLOCK_H query heads of one KV head with tl.dot, so K and V are read once
per group. tl.dot needs every dim >= 16 on the GPU, so the head block is padded up to 16: a group
of 4 (or MHA's group of 1) leaves rows idle — tensor-core work, not bytes; on an H200 this beat
an elementwise MHA kernel.

CUDA graphs: nothing here reads a device tensor on the host, and the grids depend only on
shapes and num_kv_splits. Padded rows (seq_len 1, req_to_token row of zeros) read slot 0.

NOTE: import this module lazily (never from common/engine/attention/__init__.py): Triton reads
TRITON_INTERPRET when a @triton.jit function is defined, and the CPU tests set it in conftest.

Why this file is long: the two kernels, the block they share and the launcher that picks their
grid and split configuration are one unit (a kernel's constexprs and its launch config change
together); the split-K kernel alone is ~150 lines once formatted.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from pdserve.common.engine import pdl
from pdserve.common.engine.attention.triton_store import kv_scales, to_pool

LOG2E = 1.4426950408889634
NO_WINDOW = 1 << 30  # "no sliding window", as a window wider than any context
# A float8 pool under a bf16 model: widen K and V to fp16 and compute q.K and p.V in fp16 (else bf16).
FP8_WIDEN_TO_F16 = True


class DecodeWorkspace:
    """Stage 1's fp32 partial outputs and log2-sum-exps, preallocated once (CUDA-graph safe)."""

    def __init__(self, max_batch: int, num_heads: int, head_dim: int, max_kv_splits: int, device):
        self.max_batch = max_batch
        self.max_kv_splits = max_kv_splits
        shape = (max_batch, num_heads, max_kv_splits)
        self.partial_out = torch.empty(shape + (head_dim,), dtype=torch.float32, device=device)
        self.partial_lse = torch.empty(shape, dtype=torch.float32, device=device)


@triton.jit
def _attend_block(
    q_tile,
    m_i,
    l_i,
    acc,
    block_start,
    lo,
    end,
    row_slots,
    k_buf,
    v_buf,
    kv_head_offset,
    stride_buf_s,
    qk_scale,
    offs_d,
    mask_d,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    WINDOWED: tl.constexpr,
):
    """Online softmax over keys [max(block_start, lo), min(block_start + BLOCK_N, end)): one gather
    of slots, then [BLOCK_N, BLOCK_D] of K and of V."""
    offs_n = block_start + tl.arange(0, BLOCK_N)
    mask_n = offs_n < end
    if WINDOWED:  # the first block may start before the window
        mask_n = mask_n & (offs_n >= lo)
    slots = tl.load(row_slots + offs_n, mask=mask_n, other=0).to(tl.int64)
    kv_offsets = slots[:, None] * stride_buf_s + kv_head_offset + offs_d[None, :]
    kv_mask = mask_n[:, None] & mask_d[None, :]
    k_tile = tl.load(k_buf + kv_offsets, mask=kv_mask, other=0.0).to(q_tile.dtype)  # [BLOCK_N, BLOCK_D]
    scores = tl.dot(q_tile, tl.trans(k_tile), input_precision=DOT_PRECISION)
    scores = tl.where(mask_n[None, :], scores * qk_scale, float("-inf"))  # [BLOCK_H, BLOCK_N]

    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v_tile = tl.load(v_buf + kv_offsets, mask=kv_mask, other=0.0).to(q_tile.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(v_tile.dtype), v_tile, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _decode_split_kernel(
    q,
    k_buf,
    v_buf,
    req_to_token,
    req_pool_indices,
    seq_lens,
    partial_out,
    partial_lse,
    out,
    k_new,
    v_new,
    out_loc,
    k_scale,
    v_scale,
    stride_q_b,
    stride_q_h,
    stride_kn_b,
    stride_kn_h,
    stride_vn_b,
    stride_vn_h,
    stride_o_b,
    stride_o_h,
    stride_buf_s,
    stride_buf_h,
    stride_r2t,
    stride_po_b,
    stride_po_h,
    stride_po_s,
    stride_lse_b,
    stride_lse_h,
    qk_scale,  # softmax scale * log2(e): scores live in the log2 domain
    window,
    num_kv_splits,
    group_size,
    head_blocks_per_group,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr,
    STORE_NEW: tl.constexpr,
    WINDOWED: tl.constexpr,
    INTERPRETED: tl.constexpr,
    KV_SCALED: tl.constexpr,
    WIDEN_TO_F16: tl.constexpr,
    PDL: tl.constexpr,
):
    req = tl.program_id(0)
    req_64 = req.to(tl.int64)
    split = tl.program_id(2)
    # The batch's lengths and pool rows are the forward's inputs, which no kernel of the forward
    # writes: read before the wait (common/engine/pdl.py), while rope_store_kv may still run. q and
    # the pool (this step's K and V) only after it.
    seq_len = tl.load(seq_lens + req, cache_modifier=".cg")
    row = tl.load(req_pool_indices + req, cache_modifier=".cg").to(tl.int64)
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    # Visible keys [lo, seq_len): the query sits at seq_len - 1. The splits cut this range (from
    # lo's block), not [0, seq_len), so a sliding window does not leave most programs idle.
    # NOTE: one split without a window loops from the constant 0. From a computed start the
    # compiler kept more live (sm_90, 2 warps, 64 keys: 144 registers instead of 112), fitting
    # fewer programs per SM.
    lo = tl.maximum(seq_len - window, 0) if WINDOWED else 0
    lo_block = (lo // BLOCK_N) * BLOCK_N
    if SINGLE_SPLIT:
        start = lo_block
        end = seq_len
    else:
        split_len = tl.cdiv(tl.cdiv(seq_len - lo_block, num_kv_splits), BLOCK_N) * BLOCK_N
        start = lo_block + split * split_len
        end = tl.minimum(start + split_len, seq_len)  # start >= end: an empty split
    row_slots = req_to_token + row * stride_r2t
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    head_block = tl.program_id(1) % head_blocks_per_group
    # Query heads of this program: a slice of KV head `kv_head`'s group (never crossing groups).
    in_group = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = in_group < group_size
    mask_hd = mask_h[:, None] & mask_d[None, :]
    kv_head = tl.program_id(1) // head_blocks_per_group
    offs_h = kv_head * group_size + in_group
    q_ptrs = q + req_64 * stride_q_b + offs_h[:, None] * stride_q_h + offs_d[None, :]
    q_tile = tl.load(q_ptrs, mask=mask_hd, other=0.0)  # [BLOCK_H, BLOCK_D]
    if WIDEN_TO_F16:
        # A float8 pool under a bf16 model: the products in fp16 (float8 -> fp16 is one convert
        # a pair, -> bf16 several; fp16 holds every e4m3 value and more of q's bits). q is clamped
        # to fp16's range (a bf16 q past 65504 would be inf).
        q_tile = tl.minimum(tl.maximum(q_tile.to(tl.float32), -65504.0), 65504.0).to(tl.float16)

    # A finite floor instead of -inf: exp2(m_old - m_new) stays 0 or 1, never nan.
    m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    kv_head_offset = kv_head.to(tl.int64) * stride_buf_h
    if STORE_NEW:
        # This step's K and V go into the pool here instead of in a launch of their own: the
        # program whose split holds the new position writes its KV head's row, and the CTA
        # barrier makes the write visible to the loads below (no other program reads it).
        if (seq_len - 1 >= start) & (seq_len - 1 < end):
            slot = tl.load(out_loc + req).to(tl.int64)
            dst = slot * stride_buf_s + kv_head_offset + offs_d
            k_row = tl.load(k_new + req_64 * stride_kn_b + kv_head * stride_kn_h + offs_d, mask=mask_d)
            tl.store(k_buf + dst, to_pool(k_row, k_scale, k_buf, KV_SCALED), mask=mask_d)
            v_row = tl.load(v_new + req_64 * stride_vn_b + kv_head * stride_vn_h + offs_d, mask=mask_d)
            tl.store(v_buf + dst, to_pool(v_row, v_scale, v_buf, KV_SCALED), mask=mask_d)
        tl.debug_barrier()
    if KV_SCALED:
        # A float8 pool: q.(k8 * k_scale) = (q.k8) * k_scale, folded into the score scale (V's
        # scale into the outputs below, before the split merge, which is linear in them).
        qk_scale = qk_scale * tl.load(k_scale)
        v_scale_value = tl.load(v_scale)
    else:
        v_scale_value = 1.0
    if INTERPRETED:
        # NOTE: Triton 3.6's interpreter int()s range() bounds, which numpy >= 2.4 refuses for
        # its 1-element scalars (triton#9171); it walks the same blocks with a while loop.
        block_start = start
        while block_start < end:
            m_i, l_i, acc = _attend_block(
                q_tile,
                m_i,
                l_i,
                acc,
                block_start,
                lo,
                end,
                row_slots,
                k_buf,
                v_buf,
                kv_head_offset,
                stride_buf_s,
                qk_scale,
                offs_d,
                mask_d,
                BLOCK_N,
                DOT_PRECISION,
                WINDOWED,
            )
            block_start += BLOCK_N
    else:
        for block_start in range(start, end, BLOCK_N):
            m_i, l_i, acc = _attend_block(
                q_tile,
                m_i,
                l_i,
                acc,
                block_start,
                lo,
                end,
                row_slots,
                k_buf,
                v_buf,
                kv_head_offset,
                stride_buf_s,
                qk_scale,
                offs_d,
                mask_d,
                BLOCK_N,
                DOT_PRECISION,
                WINDOWED,
            )

    if SINGLE_SPLIT:
        # Every visible key is in this split: its normalised output is the final one.
        o_ptrs = out + req_64 * stride_o_b + offs_h[:, None] * stride_o_h + offs_d[None, :]
        out_tile = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None] * v_scale_value
        tl.store(o_ptrs, out_tile.to(out.dtype.element_ty), mask=mask_hd)
    else:
        # An empty split writes out 0 and lse -inf, so stage 2 gives it weight 0.
        has_keys = l_i > 0.0
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        po_ptrs = partial_out + req_64 * stride_po_b + offs_h[:, None] * stride_po_h + split * stride_po_s
        tl.store(po_ptrs + offs_d[None, :], acc / tl.where(has_keys, l_i, 1.0)[:, None] * v_scale_value, mask=mask_hd)
        tl.store(partial_lse + req_64 * stride_lse_b + offs_h * stride_lse_h + split, lse, mask=mask_h)


@triton.jit
def _decode_merge_kernel(
    partial_out,
    partial_lse,
    out,
    stride_po_b,
    stride_po_h,
    stride_po_s,
    stride_lse_b,
    stride_lse_h,
    stride_o_b,
    stride_o_h,
    num_kv_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    req = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < num_kv_splits
    mask_d = offs_d < HEAD_DIM

    lse = tl.load(partial_lse + req * stride_lse_b + head * stride_lse_h + offs_s, mask=mask_s, other=float("-inf"))
    po_ptrs = partial_out + req * stride_po_b + head * stride_po_h + offs_s[:, None] * stride_po_s + offs_d[None, :]
    parts = tl.load(po_ptrs, mask=mask_s[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_S, BLOCK_D]

    # Every real request has a non-empty split (the query sees itself); the guards only keep a
    # malformed seq_len of 0 from writing nan.
    lse_max = tl.max(lse, axis=0)
    weights = tl.where(lse > float("-inf"), tl.exp2(lse - tl.maximum(lse_max, -1.0e30)), 0.0)
    total = tl.sum(weights, axis=0)
    merged = tl.sum(weights[:, None] * parts, axis=0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out + req * stride_o_b + head * stride_o_h + offs_d, merged.to(out.dtype.element_ty), mask=mask_d)


# True when TRITON_INTERPRET was set as the kernels were defined (the CPU tests).
INTERPRETED = not isinstance(_decode_split_kernel, triton.runtime.JITFunction)


def _head_block(group_size: int) -> int:
    """Query heads per stage-1 program: the group padded to tl.dot's 16, at most 64."""
    return max(16, min(64, triton.next_power_of_2(group_size)))


def _split_config(block_d: int, group_size: int, programs: int, num_sms: int, float8: bool = False) -> dict:
    """Stage 1's keys per iteration (BLOCK_N), warps and stages, tuned on an H200 in bf16 with
    ~300-token contexts (sweeps of this kernel; bench/micro/tune_kernels.py --attention): 64 keys x
    2 stages (Llama's GQA 4 at batch 128: 23.4 us a layer; 32 x 3: 24.8), except for MHA with more
    programs than fit an SM 8 at a time (~114 registers each at 64 keys): there 32-key blocks win
    (GPT-2 with its K/V store, 12 heads: batch 128 35.8 vs 37.9 us, batch 96 30.2 vs 33.0; batch 80
    and below 64 keys win, 23.4 vs 28.1 us at 80, 14.5 vs 21.7 at 32).

    A float8 pool at head_dim 128 (Llama-8B's heads; bench/micro/tune_kernels.py --fp8-attention, H100):
    64 keys, 2 warps, 3 stages. Against 128 keys x 4 warps x 3 stages (the previous choice, best at
    1024 keys) and bf16's settings, us a layer: batch 64 x 160 keys 15.3 / 19.0 / 19.9, batch 128 x
    160 29.1 / 35.1 / 31.2, batch 256 x 160 51.6 / 65.1 / 55.0, batch 64 x 1024 63.3 / 62.2 / 89.1,
    batch 256 x 1024 224.3 / 225.6 / 265.8, batch 256 x 1280 276.4 / 277.0 / 330.3 (one call).

    A bf16 pool at head_dim 128 (bench/micro/tune_kernels.py --decode-tiles, H100): 64 keys, 2 warps, 2
    stages. Against 64 x 4 warps x 2 stages (the previous choice), us a layer: batch 64 x 160 keys
    19.0 / 20.6, batch 128 x 160 35.2 / 35.5, batch 64 x 1024 93.6 / 94.1, batch 256 x 1024 360.7 /
    367.7 (one call; 32 keys x 4 warps x 3 stages won the short contexts, 18.5 and 33.9, and lost the
    long ones)."""
    if float8 and block_d > 64:
        return dict(BLOCK_N=64, num_warps=2, num_stages=3)
    if block_d > 64:
        return dict(BLOCK_N=64, num_warps=2, num_stages=2)
    if group_size == 1 and programs > 8 * num_sms:
        return dict(BLOCK_N=32, num_warps=2, num_stages=2)
    return dict(BLOCK_N=64, num_warps=2, num_stages=2)


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # the interpreter: any count will do
    return torch.cuda.get_device_properties(device).multi_processor_count


def num_kv_splits_for(batch_size: int, num_heads: int, num_kv_heads: int, max_kv_splits: int) -> int:
    """A power-of-two split count that gives stage 1 about 512 programs, the sweet spot measured on
    an H200 (132 SMs) at ~300-token contexts: 8-16 splits at batch 1, 1 from batch ~64 (GQA 4).
    A host-side function of the batch size alone, so one value per captured CUDA graph."""
    group_size = num_heads // num_kv_heads
    programs = batch_size * num_kv_heads * triton.cdiv(group_size, _head_block(group_size))
    splits = 1
    while 2 * splits <= max_kv_splits and 2 * splits * programs <= 512:
        splits *= 2
    return splits


def decode_attention(
    q,
    k_buf,
    v_buf,
    out,
    req_to_token,
    req_pool_indices,
    seq_lens,
    scale: float,
    sliding_window: int | None,
    num_kv_splits: int,
    workspace: DecodeWorkspace,
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
    out_loc: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Flash-decoding (split-K) paged attention, one new query token per request.

    q, out: [B, H, D]; k_buf, v_buf: [S, KVH, D] (pool; query head h reads KV head h // (H // KVH));
    req_to_token: [R, C] int32 (row, position -> slot); req_pool_indices: [B] int64;
    seq_lens: [B] int32 or int64 on the device: KV length including the new token (already stored); the
    query is at position seq_len - 1. With sliding_window w (None or 0 = off) only positions p
    with (seq_len - 1) - p < w are visible. Output in q's dtype. No host sync (CUDA-graph safe).

    With k_new, v_new [B, KVH, D] (strided views are fine) and out_loc [B] int64, this step's K
    and V are first stored at out_loc in the same launch (store_kv's contract: padded rows may all
    write slot 0); otherwise they must already be in the pool. A float8 pool needs its layer's
    k_scale and v_scale ([1] fp32 device tensors): read K = k8 * k_scale, V = v8 * v_scale.
    """
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_buf.shape[1]
    if batch == 0:
        return
    assert out.shape == q.shape and k_buf.shape[2] == head_dim and v_buf.shape == k_buf.shape
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    assert q.stride(2) == out.stride(2) == k_buf.stride(2) == 1 and v_buf.stride() == k_buf.stride()
    assert req_to_token.stride(1) == 1
    assert 1 <= num_kv_splits <= workspace.max_kv_splits and batch <= workspace.max_batch
    assert workspace.partial_out.shape[1:] == (num_heads, workspace.max_kv_splits, head_dim)

    group_size = num_heads // num_kv_heads
    block_h = _head_block(group_size)
    head_blocks_per_group = triton.cdiv(group_size, block_h)
    # tl.dot needs K >= 16 on the GPU; masks cover the padding (and non-powers of two like 80).
    block_d = max(16, triton.next_power_of_2(head_dim))
    partial_out, partial_lse = workspace.partial_out, workspace.partial_lse
    window = sliding_window if sliding_window else NO_WINDOW

    store = k_new is not None
    if store:
        assert k_new.shape == v_new.shape == (batch, num_kv_heads, head_dim) and out_loc.shape == (batch,)
        assert k_new.stride(2) == v_new.stride(2) == 1
    else:
        k_new = v_new = out_loc = q  # not read
    grid = (batch, num_kv_heads * head_blocks_per_group, num_kv_splits)
    k_scale, v_scale, kv_scaled = kv_scales(k_buf, k_scale, v_scale)
    _decode_split_kernel[grid](
        q,
        k_buf,
        v_buf,
        req_to_token,
        req_pool_indices,
        seq_lens,
        partial_out,
        partial_lse,
        out,
        k_new,
        v_new,
        out_loc,
        k_scale,
        v_scale,
        q.stride(0),
        q.stride(1),
        k_new.stride(0),
        k_new.stride(1),
        v_new.stride(0),
        v_new.stride(1),
        out.stride(0),
        out.stride(1),
        k_buf.stride(0),
        k_buf.stride(1),
        req_to_token.stride(0),
        partial_out.stride(0),
        partial_out.stride(1),
        partial_out.stride(2),
        partial_lse.stride(0),
        partial_lse.stride(1),
        scale * LOG2E,
        window,
        num_kv_splits,
        group_size,
        head_blocks_per_group,
        HEAD_DIM=head_dim,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # fp32 must not drop to tf32
        SINGLE_SPLIT=num_kv_splits == 1,
        STORE_NEW=store,
        WINDOWED=window != NO_WINDOW,
        INTERPRETED=INTERPRETED,
        KV_SCALED=kv_scaled,
        WIDEN_TO_F16=kv_scaled and q.dtype == torch.bfloat16 and FP8_WIDEN_TO_F16,
        PDL=pdl.enabled(q.device),
        launch_pdl=pdl.enabled(q.device),
        **_split_config(block_d, group_size, grid[0] * grid[1] * grid[2], _num_sms(q.device), kv_scaled),
    )
    if num_kv_splits == 1:
        return
    _decode_merge_kernel[(batch, num_heads)](
        partial_out,
        partial_lse,
        out,
        partial_out.stride(0),
        partial_out.stride(1),
        partial_out.stride(2),
        partial_lse.stride(0),
        partial_lse.stride(1),
        out.stride(0),
        out.stride(1),
        num_kv_splits,
        HEAD_DIM=head_dim,
        BLOCK_S=triton.next_power_of_2(num_kv_splits),
        BLOCK_D=block_d,
        PDL=pdl.enabled(q.device),
        launch_pdl=pdl.enabled(q.device),
        num_warps=1 if block_d <= 64 else 2,
    )
