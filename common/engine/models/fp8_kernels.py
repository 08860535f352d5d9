"""FP8 linear layers' small kernels, for CUDA (imported on first use, as triton_ops is):

    quantize_per_token(x, min_amax)        fp8.quantize_per_token as one launch
    scale_output(acc, sx, sw, bias, dtype) acc * sx[m] * sw[n] + bias[n], rounded once to dtype: the
                                           epilogue of fp8.py's tensor-wise GEMM path

quantize_per_token:

torch's ops take six launches per linear layer (abs, amax, the fp32 cast, the divide, the float8
cast, and the scale's own arithmetic): on an H200, replayed from a CUDA graph at Llama-1B and 8B
shapes and 1 to 256 tokens, 12-35 us a layer, more than the FP8 GEMM it feeds (8-45 us); this
kernel takes 2-7 us. One program per token row reads the row once, takes its amax, and writes the
float8 row and its fp32 scale. The numbers are torch's: an
IEEE fp32 divide (`div_rn`, not Triton's default approximate one) and round-to-nearest-even into
float8_e4m3fn (saturating; never reached, see fp8.quantize_per_token).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _quantize_rows(x_ptr, q_ptr, scale_ptr, cols, x_row_stride, min_amax, fp8_max, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < cols
    x = tl.load(x_ptr + row * x_row_stride + offs, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=0), min_amax) / fp8_max
    q = tl.math.div_rn(x, tl.zeros([BLOCK], tl.float32) + scale)
    tl.store(q_ptr + row * cols + offs, q.to(tl.float8e4nv), mask=mask)
    tl.store(scale_ptr + row, scale)


def quantize_per_token(x: torch.Tensor, min_amax: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(xq float8_e4m3fn [M, K], sx fp32 [M, 1]) of a 2-D CUDA tensor, as fp8.quantize_per_token
    (which passes its `min_amax`: this module imports nothing of fp8.py, which imports it)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows, cols = x.shape
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(cols)
    # NOTE: the whole row sits in registers (one pass over x): 8 warps keep a 16k-wide row
    # (Llama-8B's down_proj input, 14336) at 64 values a thread.
    _quantize_rows[(rows,)](
        x, q, scale, cols, x.stride(0), min_amax, 448.0, BLOCK=block, num_warps=8 if block >= 4096 else 4
    )
    return q, scale


@triton.jit
def _scale_output(acc_ptr, sx_ptr, sw_ptr, bias_ptr, out_ptr, cols, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < cols
    acc = tl.load(acc_ptr + row * cols + offs, mask=mask, other=0.0)
    y = acc * tl.load(sx_ptr + row) * tl.load(sw_ptr + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * cols + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def scale_output(
    acc: torch.Tensor, x_scale: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None, dtype
) -> torch.Tensor:
    """acc [M, N] fp32 (an unscaled FP8 GEMM's sums) * x_scale [M, 1] * weight_scale [N] + bias [N],
    rounded once to `dtype`: the numbers of fp8.emulated_fp8_mm up to the order of fp32 products."""
    rows, cols = acc.shape
    out = torch.empty(rows, cols, dtype=dtype, device=acc.device)
    block = min(1024, triton.next_power_of_2(cols))
    _scale_output[(rows, triton.cdiv(cols, block))](
        acc, x_scale, weight_scale, bias if bias is not None else acc, out, cols, HAS_BIAS=bias is not None, BLOCK=block
    )
    return out
