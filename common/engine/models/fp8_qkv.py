"""The FP8 q/k/v projection with rotary and the KV store in its epilogue, for CUDA (imported on first
use, as fp8_kernels is):

    rope_tile_order(heads, head_dim)        the merged qkv weight's row order this kernel reads
    permute_for_rope(qkv, head_dim)         an Fp8Linear's rows put in that order, once, at fuse time
    qkv_rope_store(...)                     fp8_gemm + attention/triton_store.rope_store_kv, one launch

Why: a Llama decode step's layer ran fp8_gemm for q/k/v, then rope_store_kv (neox rotary on q and k
in place, K and V into the paged pool) as a launch of its own that reads back what the GEMM had just
written. The GEMM's program holds the rows it computed, so its epilogue can rotate and store them,
if a program's rows include each dim's rotary partner: dim d of a head pairs with d + head_dim / 2,
and a program computes 64 consecutive rows of the output (fp8_kernels.gemm_config).

Row order: each 64-row tile of the permuted weight holds 32 dims of one head's first half and their
32 partners, `[hD + 32j, hD + 32j + 32)` then `[hD + D/2 + 32j, hD + D/2 + 32j + 32)` for head h,
quarter j (so head_dim a multiple of 64: Llama's 64 and 128). The epilogue writes every row back to
its own column, so the output [M, N] is the unpermuted GEMM's; other paths that run the permuted
layer (prefill past TRITON_MAX_TOKENS, the emulated GEMM) put the columns back after it
(Fp8Linear.forward).

The numbers are those of the two launches, bit for bit (tests/test_fp8_qkv.py): the GEMM's epilogue
rounds to the model dtype first, then rope_'s arithmetic (triton_ops._rope_cos_sin, _rotate_store)
and store_kv's (triton_store.to_pool).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents
from triton.tools.tensor_descriptor import TensorDescriptor

from pdserve.common.engine.attention.triton_store import kv_scales, to_pool
from pdserve.common.engine.models.fp8_kernels import _epilogue_operands, gemm_config, pdl

TILE = 64  # weight rows a program computes (fp8_kernels.gemm_config's BLOCK_N)
HALF_TILE = TILE // 2


def rope_tile_order(heads: int, head_dim: int) -> torch.Tensor:
    """Row i of the permuted weight is row order[i] of the merged one ([heads * head_dim] rows: q's,
    k's, v's heads in turn)."""
    if head_dim % TILE:
        raise ValueError(f"the fused q/k/v epilogue needs head_dim a multiple of {TILE}, got {head_dim}")
    half = head_dim // 2
    order = []
    for head in range(heads):
        for quarter in range(head_dim // TILE):
            first = head * head_dim + quarter * HALF_TILE
            order += range(first, first + HALF_TILE)
            order += range(first + half, first + half + HALF_TILE)
    return torch.tensor(order, dtype=torch.int64)


def permute_for_rope(qkv, head_dim: int) -> None:
    """Put a merged FP8 q/k/v layer's rows (and their scales, bias) in rope_tile_order, in place;
    `qkv.column_order` then says where each output column went (Fp8Linear.forward undoes it on the
    paths that are not qkv_rope_store)."""
    order = rope_tile_order(qkv.out_features // head_dim, head_dim).to(qkv.weight.device)
    qkv.rope_head_dim = head_dim
    if head_dim == TILE:  # a tile is a whole head, its partners 32 rows on: the order is the rows'
        return
    with torch.no_grad():
        qkv.weight.data = qkv.weight.data[order].contiguous()
        qkv.weight_scale.data = qkv.weight_scale.data[order].contiguous()
        if qkv.bias is not None:
            qkv.bias.data = qkv.bias.data[order].contiguous()
    qkv.column_order = torch.argsort(order)  # permuted output.index_select(-1, column_order): the merged one's


@triton.jit
def _rotated_or_not(y, pid_n, positions, inv_freq, offs_m, m_ok, rotated, HEAD_DIM: tl.constexpr,
                    BLOCK_M: tl.constexpr):  # fmt: skip
    """The tile's two halves (y [TILE, BLOCK_M] in the model dtype: rows [0, 32) and their partners
    [32, 64)), rotated when `rotated` (q and k heads) as rope_ would, else as they are."""
    y1, y2 = tl.split(tl.permute(tl.reshape(y, [2, 32, BLOCK_M]), (1, 2, 0)))
    if rotated:
        dtype = y.dtype
        freq = (pid_n % (HEAD_DIM // 64)) * 32 + tl.arange(0, 32)
        # triton_ops._rope_cos_sin's numbers: fp32 angles, cos and sin rounded to the model dtype
        angle = (
            tl.load(positions + offs_m, mask=m_ok, other=0, cache_modifier=".cg").to(tl.float32)[None, :]
            * tl.load(inv_freq + freq)[:, None]
        )
        cos = tl.cos(angle).to(dtype).to(tl.float32)
        sin = tl.sin(angle).to(dtype).to(tl.float32)
        # triton_ops._rotate_store's: each product rounds to the dtype
        a1, a2 = y1.to(tl.float32), y2.to(tl.float32)
        y1, y2 = (
            ((a1 * cos).to(dtype).to(tl.float32) + (-a2 * sin).to(dtype).to(tl.float32)).to(dtype),
            ((a2 * cos).to(dtype).to(tl.float32) + (a1 * sin).to(dtype).to(tl.float32)).to(dtype),
        )
    return y1, y2


@triton.jit
def _qkv_rope_store_tma(
    w_desc, x_desc, sw_ptr, sx_ptr, bias_ptr, out_ptr, positions, inv_freq, loc, k_buf, v_buf, k_scale, v_scale,
    M, out_row_stride, stride_buf_s, stride_buf_h, q_heads, kv_heads,
    K: tl.constexpr, HEAD_DIM: tl.constexpr, HAS_BIAS: tl.constexpr, QUANTIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    n = (q_heads + 2 * kv_heads) * HEAD_DIM
    if PDL:  # as fp8_kernels._fp8_gemm_tma
        gdc_launch_dependents()
    sw, sx, bias = _epilogue_operands(pid_n, pid_m, sw_ptr, sx_ptr, bias_ptr, M, n, HAS_BIAS, BLOCK_N, BLOCK_M, PDL)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w = w_desc.load([pid_n * BLOCK_N, k0])
        x = x_desc.load([pid_m * BLOCK_M, k0])
        acc = tl.dot(w, x.T, acc)
    # fp8_kernels._gemm_epilogue's numbers: (acc * sx) * sw, + bias, rounded once to the model dtype
    y = acc * sx[None, :] * sw[:, None]
    if HAS_BIAS:
        y += bias[:, None]
    y = y.to(out_ptr.dtype.element_ty)

    head = pid_n // (HEAD_DIM // 64)  # q's heads, then k's, then v's
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    y1, y2 = _rotated_or_not(y, pid_n, positions, inv_freq, offs_m, m_ok, head < q_heads + kv_heads, HEAD_DIM, BLOCK_M)
    dims = (pid_n % (HEAD_DIM // 64)) * 32 + tl.arange(0, 32)  # y1's dims within the head; y2's + HEAD_DIM / 2
    out = out_ptr + offs_m[None, :] * out_row_stride + head * HEAD_DIM + dims[:, None]
    tl.store(out, y1, mask=m_ok[None, :])
    tl.store(out + HEAD_DIM // 2, y2, mask=m_ok[None, :])
    if head >= q_heads:  # K or V: also into the pool, at each token's slot (store_kv's contract)
        slot = tl.load(loc + offs_m, mask=m_ok, other=0, cache_modifier=".cg").to(tl.int64)
        if head < q_heads + kv_heads:
            dst = k_buf + slot[None, :] * stride_buf_s + (head - q_heads).to(tl.int64) * stride_buf_h + dims[:, None]
            tl.store(dst, to_pool(y1, k_scale, k_buf, QUANTIZE), mask=m_ok[None, :])
            tl.store(dst + HEAD_DIM // 2, to_pool(y2, k_scale, k_buf, QUANTIZE), mask=m_ok[None, :])
        else:
            kv_head = (head - q_heads - kv_heads).to(tl.int64)
            dst = v_buf + slot[None, :] * stride_buf_s + kv_head * stride_buf_h + dims[:, None]
            tl.store(dst, to_pool(y1, v_scale, v_buf, QUANTIZE), mask=m_ok[None, :])
            tl.store(dst + HEAD_DIM // 2, to_pool(y2, v_scale, v_buf, QUANTIZE), mask=m_ok[None, :])


# True when TRITON_INTERPRET was set as the kernel was defined (the CPU tests: it runs on CPU tensors).
INTERPRETED = not isinstance(_qkv_rope_store_tma, triton.runtime.JITFunction)


def usable(device: torch.device) -> bool:
    """Whether the kernel runs on this device: a GPU with TMA (Hopper on), or the interpreter."""
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (9, 0)
    return device.type == "cpu" and INTERPRETED


def runs(xq: torch.Tensor, qkv) -> bool:
    """Whether qkv_rope_store can run this permuted layer on xq: one GEMM launch (no K split) with
    operands TMA can read (the caller checks the token count: fp8.TRITON_MAX_TOKENS)."""
    from pdserve.common.engine.models.fp8_kernels import tma_describable

    m, k = xq.shape
    return usable(xq.device) and gemm_config(m, qkv.out_features, k)["SPLIT_K"] == 1 and tma_describable(xq, qkv.weight)


def qkv_rope_store(xq, x_scale, qkv, dtype, positions, inv_freq, q_heads, kv_heads, k_buf, v_buf, loc,
                   k_scale=None, v_scale=None) -> torch.Tensor:  # fmt: skip
    """`fp8_gemm(xq, x_scale, ...)` of the unpermuted q/k/v layer, then
    `rope_store_kv(q, k, v, positions, inv_freq, k_buf, v_buf, loc, k_scale, v_scale)` on its q, k, v
    views, as one launch: the [M, N] output (q and k rotated), and K and V written at `loc`.
    `qkv`: an Fp8Linear made so by permute_for_rope; `runs` says where."""
    m, k = xq.shape
    head_dim = qkv.rope_head_dim
    assert qkv.out_features == (q_heads + 2 * kv_heads) * head_dim and 2 * inv_freq.numel() == head_dim
    assert k_buf.shape[1:] == (kv_heads, head_dim) and v_buf.stride() == k_buf.stride() and k_buf.stride(2) == 1
    out = torch.empty(m, qkv.out_features, dtype=dtype, device=xq.device)
    if m == 0:
        return out
    cfg = gemm_config(m, qkv.out_features, k)
    assert cfg["BLOCK_N"] == TILE and cfg["SPLIT_K"] == 1, cfg
    w_desc = TensorDescriptor.from_tensor(qkv.weight, [TILE, cfg["BLOCK_K"]])
    x_desc = TensorDescriptor.from_tensor(xq, [cfg["BLOCK_M"], cfg["BLOCK_K"]])
    k_scale, v_scale, quantize = kv_scales(k_buf, k_scale, v_scale)
    bias = qkv.bias if qkv.bias is not None else qkv.weight_scale
    grid = (qkv.out_features // TILE, triton.cdiv(m, cfg["BLOCK_M"]))
    _qkv_rope_store_tma[grid](
        w_desc, x_desc, qkv.weight_scale, x_scale, bias, out, positions, inv_freq, loc, k_buf, v_buf, k_scale,
        v_scale, m, out.stride(0), k_buf.stride(0), k_buf.stride(1), q_heads, kv_heads, K=k, HEAD_DIM=head_dim,
        HAS_BIAS=qkv.bias is not None, QUANTIZE=quantize, BLOCK_N=TILE, BLOCK_M=cfg["BLOCK_M"], BLOCK_K=cfg["BLOCK_K"],
        PDL=pdl(xq.device), launch_pdl=pdl(xq.device), num_stages=cfg["num_stages"], num_warps=cfg["num_warps"],
    )  # fmt: skip
    return out
