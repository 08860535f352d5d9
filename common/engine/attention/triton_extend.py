"""Triton kernel: prefill (extend) attention over a cached prefix, reading the KV from the pool.

Grid (query heads, query blocks, requests): a program takes BLOCK_M consecutive new queries of
one request and one head, and walks that request's keys through req_to_token from the start of
the block's sliding window to the causal bound of its last query. The new tokens' K and V are
already in the pool (the backend stores them first), so prefix and new keys are one walk; only
the key blocks at the causal diagonal and the window's edge pay for masks. Heads of one request
and KV group are adjacent in the grid, so their shared K/V stays in L2. A float8 pool is the
exception: the new tokens' K and V are read from the forward's own tensors, not the pool (the
prefix from the pool and the new keys from those tensors, each walked as above: _walk).

NOTE: import this module lazily (never from common/engine/attention/__init__.py): Triton reads
TRITON_INTERPRET when a @triton.jit function is defined, and the CPU tests set it in conftest.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.common.engine.attention.triton_store import kv_scales

LOG2E = 1.4426950408889634
# A float8 pool under a bf16 model: the prefix's q.K and p.V in fp16 (triton_decode.FP8_WIDEN_TO_F16's).
FP8_WIDEN_TO_F16 = True


@triton.jit
def _attend_block(
    q_tile, q_pos, m_i, l_i, acc, block_start, end, window, src, qk_scale, offs_d,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr, USE_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr, FROM_NEW: tl.constexpr, SCALED: tl.constexpr,
):  # fmt: skip
    """Online softmax over keys [block_start, min(block_start + BLOCK_N, end)): [BLOCK_N, BLOCK_D]
    of K and of V. MASKED: apply the bound, causal and window masks; without it the block must be
    whole and visible to every query. Where the keys are (`src`, a tuple; the last item V's scale):
      the pool:           (row_slots, k_buf, v_buf, kv_head_offset, stride_buf_s, v_scale), one
                          gather of slots through req_to_token;
      FROM_NEW, the forward's own K and V: (k_new, v_new, k token stride, v token stride,
                          prefix_len, 1.0), row = position - prefix_len.
    SCALED: a float8 pool's V scale multiplies p.V (K's is in qk_scale)."""
    offs_n = block_start + tl.arange(0, BLOCK_N)
    mask_d = offs_d < HEAD_DIM
    if MASKED:
        mask_n = offs_n < end
        kv_mask = mask_n[:, None] & mask_d[None, :]
    else:
        kv_mask = mask_d[None, :]
    if FROM_NEW:
        rows = (offs_n - src[4]).to(tl.int64)
        k_ptrs = src[0] + rows[:, None] * src[2] + offs_d[None, :]
        v_ptrs = src[1] + rows[:, None] * src[3] + offs_d[None, :]
    else:
        if MASKED:
            slots = tl.load(src[0] + offs_n, mask=mask_n, other=0).to(tl.int64)
        else:
            slots = tl.load(src[0] + offs_n).to(tl.int64)
        kv_offsets = slots[:, None] * src[4] + src[3] + offs_d[None, :]
        k_ptrs = src[1] + kv_offsets
        v_ptrs = src[2] + kv_offsets
    k_tile = tl.load(k_ptrs, mask=kv_mask, other=0.0).to(q_tile.dtype)  # [BLOCK_N, BLOCK_D]
    scores = tl.dot(q_tile, tl.trans(k_tile), input_precision=DOT_PRECISION) * qk_scale
    if MASKED:
        distance = q_pos[:, None] - offs_n[None, :]
        visible = mask_n[None, :] & (distance >= 0)
        if USE_WINDOW:
            visible = visible & (distance < window)
        scores = tl.where(visible, scores, float("-inf"))  # [BLOCK_M, BLOCK_N]

    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v_tile = tl.load(v_ptrs, mask=kv_mask, other=0.0).to(q_tile.dtype)
    pv = tl.dot(p.to(v_tile.dtype), v_tile, input_precision=DOT_PRECISION)
    if SCALED:
        pv = pv * src[5]
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit
def _attend_range(
    q_tile, q_pos, m_i, l_i, acc, start, end, window, src, qk_scale, offs_d,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr, USE_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr, INTERPRETED: tl.constexpr, FROM_NEW: tl.constexpr, SCALED: tl.constexpr,
):  # fmt: skip
    """_attend_block over keys [start, end), BLOCK_N at a time."""
    if INTERPRETED:
        # NOTE: Triton 3.6's interpreter int()s range() bounds, which numpy >= 2.4 refuses for its
        # 1-element scalars (triton#9171); it walks the same blocks with a while loop instead.
        block_start = start
        while block_start < end:
            m_i, l_i, acc = _attend_block(
                q_tile, q_pos, m_i, l_i, acc, block_start, end, window, src, qk_scale, offs_d,
                BLOCK_N, HEAD_DIM, MASKED, USE_WINDOW, DOT_PRECISION, FROM_NEW, SCALED,
            )  # fmt: skip
            block_start += BLOCK_N
    else:
        for block_start in range(start, end, BLOCK_N):
            m_i, l_i, acc = _attend_block(
                q_tile, q_pos, m_i, l_i, acc, block_start, end, window, src, qk_scale, offs_d,
                BLOCK_N, HEAD_DIM, MASKED, USE_WINDOW, DOT_PRECISION, FROM_NEW, SCALED,
            )  # fmt: skip
    return m_i, l_i, acc


@triton.jit
def _walk(
    q_tile, q_pos, m_i, l_i, acc, lo, full_lo, full_hi, hi, window, src, qk_scale, offs_d,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, USE_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr,
    INTERPRETED: tl.constexpr, FROM_NEW: tl.constexpr, SCALED: tl.constexpr,
):  # fmt: skip
    """Keys [lo, hi) from one source in three ranges (see _extend_kernel): [lo, full_lo) masked
    (the window's edge), [full_lo, full_hi) whole blocks every query sees, [full_hi, hi) masked."""
    if USE_WINDOW:
        m_i, l_i, acc = _attend_range(
            q_tile, q_pos, m_i, l_i, acc, lo, full_lo, window, src, qk_scale, offs_d,
            BLOCK_N, HEAD_DIM, True, USE_WINDOW, DOT_PRECISION, INTERPRETED, FROM_NEW, SCALED,
        )  # fmt: skip
    m_i, l_i, acc = _attend_range(
        q_tile, q_pos, m_i, l_i, acc, full_lo, full_hi, window, src, qk_scale, offs_d,
        BLOCK_N, HEAD_DIM, False, USE_WINDOW, DOT_PRECISION, INTERPRETED, FROM_NEW, SCALED,
    )  # fmt: skip
    m_i, l_i, acc = _attend_range(
        q_tile, q_pos, m_i, l_i, acc, full_hi, hi, window, src, qk_scale, offs_d,
        BLOCK_N, HEAD_DIM, True, USE_WINDOW, DOT_PRECISION, INTERPRETED, FROM_NEW, SCALED,
    )  # fmt: skip
    return m_i, l_i, acc


@triton.jit
def _extend_kernel(
    q, k_buf, v_buf, out, req_to_token, req_pool_indices, seq_lens, extend_lens, extend_starts,
    k_new, v_new, k_scale, v_scale,
    stride_kn_t, stride_kn_h, stride_vn_t, stride_vn_h, stride_q_t, stride_q_h, stride_o_t, stride_o_h,
    stride_buf_s, stride_buf_h, stride_r2t,
    qk_scale,  # softmax scale * log2(e): scores live in the log2 domain
    window, group_size,
    HEAD_DIM: tl.constexpr, USE_WINDOW: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr, INTERPRETED: tl.constexpr, KV_SCALED: tl.constexpr,
    WIDEN_TO_F16: tl.constexpr, HAS_PREFIX: tl.constexpr,
):  # fmt: skip
    head = tl.program_id(0)
    q_block = tl.program_id(1)
    req = tl.program_id(2)

    extend_len = tl.load(extend_lens + req)
    # The grid is sized by the longest extend; shorter requests' extra blocks have nothing to do.
    if q_block * BLOCK_M >= extend_len:
        return
    seq_len = tl.load(seq_lens + req)
    extend_start = tl.load(extend_starts + req).to(tl.int64)
    row = tl.load(req_pool_indices + req).to(tl.int64)
    prefix_len = seq_len - extend_len

    offs_m = q_block * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < extend_len
    q_pos = prefix_len + offs_m
    offs_d = tl.arange(0, BLOCK_D)
    mask_qd = mask_m[:, None] & (offs_d < HEAD_DIM)[None, :]
    q_rows = extend_start + offs_m
    q_ptrs = q + q_rows[:, None] * stride_q_t + head * stride_q_h + offs_d[None, :]
    q_tile = tl.load(q_ptrs, mask=mask_qd, other=0.0)  # [BLOCK_M, BLOCK_D]

    # The block's queries sit at [first_q, last_q]; it reads keys [lo, hi), in three ranges:
    #   [lo, full_lo)       outside the window of some queries          masked (window only)
    #   [full_lo, full_hi)  whole key blocks every query sees            no masks (most of the work)
    #   [full_hi, hi)       across the causal diagonal (and the rest)    masked
    first_q = prefix_len + q_block * BLOCK_M
    hi = tl.minimum(seq_len, first_q + BLOCK_M)
    lo = 0
    full_lo = 0
    if USE_WINDOW:
        lo = tl.maximum(first_q - window + 1, 0)
        full_lo = tl.minimum(tl.maximum(hi - window, lo), hi)  # the last query's window start

    # A finite floor instead of -inf: a row whose keys in a block are all masked (before its
    # window opens) keeps exp2(m_old - m_new) at 1 and p at 0, never nan.
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    kv_head = head // group_size
    pool = (req_to_token + row * stride_r2t, k_buf, v_buf, kv_head.to(tl.int64) * stride_buf_h, stride_buf_s, 1.0)
    if KV_SCALED:
        # A float8 pool: the new tokens attend to each other through the forward's own K and V, and
        # only to the prefix through the pool, as SGLang's extend kernels read it (docs/architecture.md,
        # "FP8 KV cache"). So two walks, each in the three ranges cut at prefix_len: the prefix's keys
        # come before every query (no causal mask), and its K = k8 * k_scale folds k_scale into the
        # score scale (q.(k8 s) = (q.k8) s; float8 widened to q's dtype is exact), V's into p.V.
        pool = (pool[0], k_buf, v_buf, pool[3], stride_buf_s, tl.load(v_scale))
        q_pool = q_tile
        if WIDEN_TO_F16:  # (triton_decode's reason: float8 -> fp16 is one convert a pair, -> bf16 several)
            q_pool = tl.minimum(tl.maximum(q_tile.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
        # NOTE: HAS_PREFIX False (no request of the batch has one) compiles the prefix's walk out: with
        # both walks the kernel held 248 registers instead of 168 and a prompt with no prefix took
        # 1.2x bf16's time; without, 0.8x (H100, docs/benchmarks/README.md).
        if HAS_PREFIX:
            end = tl.minimum(prefix_len, hi)
            p_lo = tl.minimum(lo, end)
            p_full_lo = tl.minimum(full_lo, end)
            p_full_hi = p_full_lo + (end - p_full_lo) // BLOCK_N * BLOCK_N
            m_i, l_i, acc = _walk(
                q_pool, q_pos, m_i, l_i, acc, p_lo, p_full_lo, p_full_hi, end, window, pool,
                qk_scale * tl.load(k_scale), offs_d, BLOCK_N, HEAD_DIM, USE_WINDOW, DOT_PRECISION, INTERPRETED, False,
                True,
            )  # fmt: skip
        k_first = k_new + extend_start * stride_kn_t + kv_head * stride_kn_h  # this request's first new row
        v_first = v_new + extend_start * stride_vn_t + kv_head * stride_vn_h
        new = (k_first, v_first, stride_kn_t, stride_vn_t, prefix_len, 1.0)
        n_lo = tl.maximum(lo, prefix_len)
        n_full_lo = tl.maximum(full_lo, prefix_len)
        n_full_hi = n_full_lo + tl.maximum(first_q + 1 - n_full_lo, 0) // BLOCK_N * BLOCK_N
        m_i, l_i, acc = _walk(
            q_tile, q_pos, m_i, l_i, acc, n_lo, n_full_lo, n_full_hi, hi, window, new,
            qk_scale, offs_d, BLOCK_N, HEAD_DIM, USE_WINDOW, DOT_PRECISION, INTERPRETED, True, False,
        )  # fmt: skip
    else:
        full_hi = full_lo + tl.maximum(first_q + 1 - full_lo, 0) // BLOCK_N * BLOCK_N
        m_i, l_i, acc = _walk(
            q_tile, q_pos, m_i, l_i, acc, lo, full_lo, full_hi, hi, window, pool,
            qk_scale, offs_d, BLOCK_N, HEAD_DIM, USE_WINDOW, DOT_PRECISION, INTERPRETED, False, False,
        )  # fmt: skip

    # Every valid row saw at least its own key (l_i > 0); the guard is for the masked-off rows.
    out_tile = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    o_ptrs = out + q_rows[:, None] * stride_o_t + head * stride_o_h + offs_d[None, :]
    tl.store(o_ptrs, out_tile.to(out.dtype.element_ty), mask=mask_qd)


# True when TRITON_INTERPRET was set as the kernels were defined (the CPU tests).
INTERPRETED = not isinstance(_extend_kernel, triton.runtime.JITFunction)


def _launch_config(head_dim: int) -> dict:
    """Block sizes and warps per head dim (tuned on an H200, bf16, prompts of 256)."""
    if head_dim <= 64:
        return dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2)
    return dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=3)


def extend_attention(
    q,
    k_buf,
    v_buf,
    out,
    req_to_token,
    req_pool_indices,
    seq_lens,
    extend_lens,
    extend_starts,
    max_extend_len: int,
    scale: float,
    sliding_window: int | None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
    has_prefix: bool = True,
) -> None:
    """Prefill over a cached prefix. q, out: [T, H, D] flat, request after request: request i owns
    rows [extend_starts[i], extend_starts[i] + extend_lens[i]); its KV (prefix + the new tokens,
    already stored in the pool) is positions [0, seq_lens[i]) read through
    req_to_token[req_pool_indices[i]]. Its j-th new query is at position seq_lens[i] - extend_lens[i] + j
    and is causal and, with sliding_window w (None or 0 = off), sees only keys with q_pos - k_pos < w.
    seq_lens, extend_lens, extend_starts: [B] int32 on the device; max_extend_len: host int (grid).
    Output in q's dtype. A float8 pool needs its layer's k_scale and v_scale ([1] fp32 device
    tensors), read K = k8 * k_scale, V = v8 * v_scale, for the prefix, and this forward's new K and
    V as computed (k_new, v_new [T, KVH, D], rows as q's; strided views are fine) for the new tokens.
    has_prefix=False (a float8 pool): promises every request's seq_len equals its extend_len, and
    leaves the prefix's walk out of the kernel.
    """
    num_tokens, num_heads, head_dim = q.shape
    batch = seq_lens.shape[0]
    num_kv_heads = k_buf.shape[1]
    if num_tokens == 0 or batch == 0 or max_extend_len == 0:
        return
    assert out.shape == q.shape and k_buf.shape[2] == head_dim and v_buf.shape == k_buf.shape
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    assert q.stride(2) == out.stride(2) == k_buf.stride(2) == 1 and v_buf.stride() == k_buf.stride()
    assert req_to_token.stride(1) == 1

    config = _launch_config(head_dim)
    grid = (num_heads, triton.cdiv(max_extend_len, config["BLOCK_M"]), batch)
    k_scale, v_scale, kv_scaled = kv_scales(k_buf, k_scale, v_scale)
    if kv_scaled:
        assert k_new is not None and v_new is not None, "a float8 KV pool needs the forward's own K and V"
        assert k_new.shape == v_new.shape == (num_tokens, num_kv_heads, head_dim)
        assert k_new.stride(2) == v_new.stride(2) == 1 and k_new.dtype == v_new.dtype == q.dtype
    else:
        k_new = v_new = q  # not read
    _extend_kernel[grid](
        q,
        k_buf,
        v_buf,
        out,
        req_to_token,
        req_pool_indices,
        seq_lens,
        extend_lens,
        extend_starts,
        k_new,
        v_new,
        k_scale,
        v_scale,
        k_new.stride(0),
        k_new.stride(1),
        v_new.stride(0),
        v_new.stride(1),
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_buf.stride(0),
        k_buf.stride(1),
        req_to_token.stride(0),
        scale * LOG2E,
        sliding_window or 0,
        num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        USE_WINDOW=bool(sliding_window),
        # tl.dot needs K >= 16 on the GPU; masks cover the padding (and non-powers of two like 80).
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # fp32 must not drop to tf32
        INTERPRETED=INTERPRETED,
        KV_SCALED=kv_scaled,
        WIDEN_TO_F16=kv_scaled and q.dtype == torch.bfloat16 and FP8_WIDEN_TO_F16,
        HAS_PREFIX=has_prefix or not kv_scaled,  # (a bf16 pool's kernel has one walk either way: one compile)
        **config,
    )
