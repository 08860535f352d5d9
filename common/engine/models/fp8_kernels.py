"""FP8 linear layers' kernels, for CUDA (imported on first use, as triton_ops is):

    quantize_per_token(x, min_amax)        fp8.quantize_per_token as one launch
    scale_output(acc, sx, sw, bias, dtype) acc * sx[m] * sw[n] + bias[n], rounded once to dtype: the
                                           epilogue of fp8.py's tensor-wise GEMM path
    fp8_gemm(xq, sx, w, sw, bias, dtype)   the decode-size FP8 GEMM (TMA or pointer tiles)
    rmsnorm_fp8, silu_mul_fp8              the ops before an FP8 layer, writing its float8 input
    gate_up_silu_fp8(xq, sx, w, sw, ...)   gate_up GEMM + silu-and-multiply + quantization, 2 launches

Why this file is long: these kernels form one chain with shared contracts (the float8 input and its
per-token scale, the GEMM epilogue's rounding order, programmatic dependent launch: PDL below), and
the fused ones are tested bitwise against the unfused ones kept beside them.

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

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from triton.tools.tensor_descriptor import TensorDescriptor

from pdserve.common.engine import pdl as _pdl


@triton.jit
def _quantize_rows(
    x_ptr, q_ptr, scale_ptr, cols, x_row_stride, min_amax, fp8_max, BLOCK: tl.constexpr, PDL: tl.constexpr
):  # fmt: skip
    if PDL:  # (common/engine/pdl.py)
        gdc_launch_dependents()
        gdc_wait()
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
        x, q, scale, cols, x.stride(0), min_amax, 448.0, BLOCK=block, PDL=pdl(x.device),
        launch_pdl=pdl(x.device), num_warps=8 if block >= 4096 else 4,
    )  # fmt: skip
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


@triton.jit
def _epilogue_operands(pid_n, pid_m, sw_ptr, sx_ptr, bias_ptr, M, N, HAS_BIAS: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """(sw, sx, bias) of a [BLOCK_N, BLOCK_M] output tile, read before the GEMM's loop so their loads'
    latency is not the epilogue's: under PDL the weight's scales and the bias (written at load, never
    by a kernel) even before the wait for the kernel before, the tokens' scales (its output) after.
    Calls gdc_wait (PDL)."""
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_ok = offs_n < N
    sw = tl.load(sw_ptr + offs_n, mask=n_ok, other=0.0)
    bias = tl.zeros([BLOCK_N], tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    if PDL:
        gdc_wait()  # launched before the kernel that wrote x and sx had finished (common/engine/pdl.py)
    sx = tl.load(sx_ptr + offs_m, mask=offs_m < M, other=0.0)
    return sw, sx, bias


@triton.jit
def _gemm_epilogue(
    acc, pid_n, pid_m, pid_k, sw, sx, bias, out_ptr, partial_ptr, M, N, out_row_stride,
    SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    """A [BLOCK_N, BLOCK_M] tile of the output's transpose: scaled (sw [BLOCK_N], sx [BLOCK_M]: the
    tile's, _epilogue_operands), biased and rounded into out [M, N], or (K split) its unscaled fp32
    sums into partial [SPLIT_K, M, N]."""
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_ok = offs_n < N
    m_ok = offs_m < M
    ok = n_ok[:, None] & m_ok[None, :]
    if SPLIT_K > 1:  # unscaled partial sums [SPLIT_K, M, N]; _sum_partials adds them and scales
        tl.store(partial_ptr + (pid_k * M + offs_m[None, :]) * N + offs_n[:, None], acc, mask=ok)
    else:
        y = acc * sx[None, :] * sw[:, None]  # (acc * sx) * sw: scale_output's order
        if HAS_BIAS:
            y += bias[:, None]
        tl.store(out_ptr + offs_m[None, :] * out_row_stride + offs_n[:, None], y.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _fp8_gemm_swapped(
    w_ptr, x_ptr, sw_ptr, sx_ptr, bias_ptr, out_ptr, partial_ptr, M, N, w_row_stride, x_row_stride, out_row_stride,
    K: tl.constexpr, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """fp8_gemm's kernel where the tensor-memory accelerator is not used (before Hopper, or an
    operand TMA cannot describe): tiles gathered by pointer."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    m_ok = offs_m < M
    k_first = pid_k * (K // SPLIT_K)  # (fp8_gemm splits only where BLOCK_K divides each part)
    w_ptrs = w_ptr + offs_n[:, None] * w_row_stride + (k_first + offs_k)[None, :]
    x_ptrs = x_ptr + offs_m[None, :] * x_row_stride + (k_first + offs_k)[:, None]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    # K is a constexpr: a model has a few (hidden, intermediate), and a known trip count pipelines.
    for k0 in range(0, K // SPLIT_K, BLOCK_K):
        k_ok = (k_first + k0 + offs_k) < K
        w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(x_ptrs, mask=m_ok[None, :] & k_ok[:, None], other=0.0)
        acc = tl.dot(w, x, acc)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    sw, sx, bias = _epilogue_operands(pid_n, pid_m, sw_ptr, sx_ptr, bias_ptr, M, N, HAS_BIAS, BLOCK_N, BLOCK_M, False)
    _gemm_epilogue(acc, pid_n, pid_m, pid_k, sw, sx, bias, out_ptr, partial_ptr, M, N, out_row_stride,
                   SPLIT_K, HAS_BIAS, BLOCK_N, BLOCK_M)  # fmt: skip


@triton.jit
def _fp8_gemm_tma(
    w_desc, x_desc, sw_ptr, sx_ptr, bias_ptr, out_ptr, partial_ptr, M, N, out_row_stride,
    K: tl.constexpr, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """_fp8_gemm_swapped's tiles, read by the tensor-memory accelerator (Hopper's TMA: one
    instruction a tile, no address arithmetic in the threads; rows and columns past the tensor's
    edge come back as zeros). At Llama-8B's projections, 64 tokens, weights past L2, H100: 1-14%
    faster than the pointer kernel (docs/benchmarks/fp8.md, "FP8 decode step, third pass")."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    k_first = pid_k * (K // SPLIT_K)
    if PDL:
        gdc_launch_dependents()
    sw, sx, bias = _epilogue_operands(pid_n, pid_m, sw_ptr, sx_ptr, bias_ptr, M, N, HAS_BIAS, BLOCK_N, BLOCK_M, PDL)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, K // SPLIT_K, BLOCK_K):
        w = w_desc.load([pid_n * BLOCK_N, k_first + k0])
        x = x_desc.load([pid_m * BLOCK_M, k_first + k0])  # [BLOCK_M, BLOCK_K]: K-major, as FP8 MMAs need
        acc = tl.dot(w, x.T, acc)
    _gemm_epilogue(acc, pid_n, pid_m, pid_k, sw, sx, bias, out_ptr, partial_ptr, M, N, out_row_stride,
                   SPLIT_K, HAS_BIAS, BLOCK_N, BLOCK_M)  # fmt: skip


@triton.jit
def _sum_partials(
    partial_ptr, sx_ptr, sw_ptr, bias_ptr, out_ptr, M, N, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr, PDL: tl.constexpr, SCALED: tl.constexpr = True,
):  # fmt: skip
    """out [M, N] (rows contiguous) = the SPLIT_K partials [SPLIT_K, M, N] added in order, times the
    token's and the row's scale (SCALED: per-channel partials are unscaled; block-wise ones
    (fp8_block_kernels) took their groups' scales already), + bias, rounded once."""
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    # The weight's scales and the bias before the wait (no kernel writes them: _epilogue_operands).
    sw = tl.load(sw_ptr + offs, mask=mask, other=0.0) if SCALED else tl.zeros([BLOCK], tl.float32)
    bias = tl.load(bias_ptr + offs, mask=mask, other=0.0).to(tl.float32) if HAS_BIAS else tl.zeros([BLOCK], tl.float32)
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    acc = tl.zeros([BLOCK], tl.float32)
    for s in range(SPLIT_K):  # in order: the same sums whatever order the parts finished in
        acc += tl.load(partial_ptr + (s * M + row) * N + offs, mask=mask, other=0.0)
    y = acc
    if SCALED:
        y = acc * tl.load(sx_ptr + row) * sw
    if HAS_BIAS:
        y += bias
    tl.store(out_ptr + row * N + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def gemm_config(m: int, n: int, k: int, tma: bool = True) -> dict:
    """Tile sizes, pipeline depth and K split of fp8_gemm for an [m, k] x [n, k]^T product.

    64 weight rows a program; K in steps of 256 (gate_up beyond 64 tokens: 128, programs enough);
    K split in two where it is long and the rows few (down_proj: 64 programs otherwise, each
    reading all of x's 14336 columns). The TMA kernel's pipeline depths are from a sweep at
    Llama-8B's projections, 64 and 128 tokens, on an H100 (docs/benchmarks/fp8.md, "FP8 decode step,
    third pass"): 6 tiles in flight for o_proj (few programs), 3-4 elsewhere, as shared memory
    allows at 128 tokens. The pointer kernel's are from the H200 sweep of "FP8 weights at decode".

    NOTE the split depends on the weight's shape only, never on m: a CUDA graph's padded batch and
    the eager batch then sum in the same order (the graph-vs-eager token tests rely on it)."""
    many_rows = n > 8192
    block_m = max(16, min(128, triton.next_power_of_2(m)))
    split = 2 if k >= 8192 and not many_rows else 1
    if not tma:
        stages, warps = (3, 8) if many_rows and m <= 64 else (4, 4)
        return {"BLOCK_N": 64, "BLOCK_M": block_m, "BLOCK_K": 128 if many_rows else 256, "SPLIT_K": split,
                "num_stages": stages, "num_warps": warps}  # fmt: skip
    if many_rows:
        block_k, stages = (256, 3) if block_m <= 64 else (128, 4)
    else:
        block_k, stages = 256, 6 if block_m <= 64 and n <= k and split == 1 else 4
    return {"BLOCK_N": 64, "BLOCK_M": block_m, "BLOCK_K": block_k, "SPLIT_K": split, "num_stages": stages,
            "num_warps": 4}  # fmt: skip


def pdl(device: torch.device) -> bool:
    """Programmatic dependent launch for this module's kernels on this device (common/engine/pdl.py)."""
    return _pdl.enabled(device)


@functools.lru_cache(maxsize=None)
def _has_tma(device: torch.device) -> bool:
    """Hopper and later have the tensor-memory accelerator; the interpreter runs its loads too."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= (9, 0)


def tma_describable(*tensors: torch.Tensor) -> bool:
    """Whether TMA can read these 2-D tensors: rows contiguous, base and row stride 16-byte aligned."""
    return _has_tma(tensors[0].device) and all(
        t.stride(1) == 1 and t.data_ptr() % 16 == 0 and t.stride(0) * t.element_size() % 16 == 0 for t in tensors
    )


def fp8_gemm(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    dtype,
    config: dict | None = None,
    tma: bool | None = None,
) -> torch.Tensor:
    """(xq [M, K] * x_scale [M, 1]) @ (weight [N, K] * weight_scale [N])^T + bias, rounded once to
    `dtype`: an FP8 GEMM for few tokens with both scales and the bias in its epilogue, one launch
    (two with a K split: unscaled partial sums, then their sum in order and the epilogue). Tiles
    are read by TMA where the GPU has it and the operands allow (`tma` None), else by pointer.

    Why swapped (each program computes a [BLOCK_N, BLOCK_M] tile of the output's transpose): with
    few tokens the token dimension is too short for the tensor cores' M side (64 on Hopper's wgmma),
    and the weight's rows are not; the weight, the bytes that bound a decode step, is read once per
    BLOCK_M tokens (once in all up to 128). Why split K: a weight of few rows (o_proj, down_proj:
    N = hidden) gives too few programs to keep every SM streaming, and each program also reads
    all of x's K columns; a split gives each program a K slice of both."""
    m, k = xq.shape
    n = weight.shape[0]
    if m == 0:
        return torch.empty(0, n, dtype=dtype, device=xq.device)
    if tma is None:
        tma = tma_describable(xq, weight)
    cfg = dict(config or gemm_config(m, n, k, tma))
    split = cfg.pop("SPLIT_K", 1)
    if k % (split * cfg["BLOCK_K"]):
        split = 1
    out = torch.empty(m, n, dtype=dtype, device=xq.device)
    partial = torch.empty(split, m, n, dtype=torch.float32, device=xq.device) if split > 1 else out
    bias_or_any = bias if bias is not None else weight_scale
    grid = (triton.cdiv(n, cfg["BLOCK_N"]), triton.cdiv(m, cfg["BLOCK_M"]), split)
    if tma:
        w_desc = TensorDescriptor.from_tensor(weight, [cfg["BLOCK_N"], cfg["BLOCK_K"]])
        x_desc = TensorDescriptor.from_tensor(xq, [cfg["BLOCK_M"], cfg["BLOCK_K"]])
        _fp8_gemm_tma[grid](
            w_desc, x_desc, weight_scale, x_scale, bias_or_any, out, partial, m, n, out.stride(0), K=k,
            SPLIT_K=split, HAS_BIAS=bias is not None, PDL=pdl(xq.device), launch_pdl=pdl(xq.device), **cfg,
        )  # fmt: skip
    else:
        _fp8_gemm_swapped[grid](
            weight, xq, weight_scale, x_scale, bias_or_any, out, partial, m, n, weight.stride(0), xq.stride(0),
            out.stride(0), K=k, SPLIT_K=split, HAS_BIAS=bias is not None, **cfg,
        )  # fmt: skip
    if split > 1:
        block = min(1024, triton.next_power_of_2(n))
        _sum_partials[(m, triton.cdiv(n, block))](
            partial, x_scale, weight_scale, bias_or_any, out, m, n, SPLIT_K=split, HAS_BIAS=bias is not None,
            BLOCK=block, PDL=pdl(xq.device), launch_pdl=pdl(xq.device),
        )  # fmt: skip
    return out


# The FP8 layers' inputs made by the op before them, quantized as they are written: one launch where
# the op and quantize_per_token took two, and the bf16 row is never stored (a Llama-8B decode step at
# batch 64 spent 0.54 of its 4.1 ms in quantize_per_token, H200). Each computes the rounded model-dtype
# row the op writes (triton_ops.rmsnorm, triton_ops.silu_mul), then quantize_per_token's numbers on it:
# the bits of the two launches, but for rmsnorm's sum of squares, which Triton may reduce in another
# order here (a last-bit change of the variance can move a value by one float8 step).


@triton.jit
def _quantize_row_into(y, q_row, scale_ptr, row, offs, mask, min_amax, fp8_max):
    """y: one row of model-dtype values at columns `offs` (masked lanes 0), as _quantize_rows
    quantizes it, into the float8 row at q_row and its scale at scale_ptr[row]."""
    yf = y.to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(yf), axis=0), min_amax) / fp8_max
    tl.store(q_row + offs, tl.math.div_rn(yf, tl.zeros_like(yf) + scale).to(tl.float8e4nv), mask=mask)
    tl.store(scale_ptr + row, scale)


@triton.jit
def _rmsnorm_fp8(
    x, residual, q, scale, weight, stride_x, stride_r, n, eps, min_amax,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    w = tl.load(weight + cols, mask=mask, other=0.0)  # (the norm's weight: no kernel writes it, read before the wait)
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    h = tl.load(x + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual + row * stride_r + cols, mask=mask, other=0.0)
        h = (h.to(tl.float32) + r.to(tl.float32)).to(r.dtype)  # the add rounds, as in torch
        tl.store(residual + row * stride_r + cols, h, mask=mask)
    hf = h.to(tl.float32)
    normed = (hf * (1.0 / tl.sqrt(tl.sum(hf * hf, axis=0) / n + eps))).to(h.dtype)
    y = (w.to(tl.float32) * normed.to(tl.float32)).to(h.dtype)
    _quantize_row_into(y, q + row * n, scale, row, cols, mask, min_amax, 448.0)


def rmsnorm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None, min_amax: float):
    """triton_ops.rmsnorm's output (with `residual`: residual += x in place first) as (float8 [T, N],
    fp32 scales [T, 1]): quantize_per_token of the row rmsnorm would write."""
    rows, n = x.shape
    q = torch.empty(rows, n, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    if rows:
        assert x.stride(1) == 1 and (residual is None or (residual.stride(1) == 1 and residual.dtype == x.dtype))
        r = residual if residual is not None else x
        block = triton.next_power_of_2(n)
        # NOTE triton_ops.rmsnorm's warps. Still, the sum of squares may be reduced in another order
        # than its kernel's (the layout Triton picks depends on the whole kernel): at width 4096 on an
        # H200 a few values came out one float8 step apart (tests/gpu/test_fp8_cuda.py bounds it).
        _rmsnorm_fp8[(rows,)](
            x, r, q, scale, weight, x.stride(0), r.stride(0), n, eps, min_amax, HAS_RESIDUAL=residual is not None,
            BLOCK=block, PDL=pdl(x.device), launch_pdl=pdl(x.device), num_warps=min(max(block // 256, 1), 8),
        )  # fmt: skip
    return q, scale


@triton.jit
def _silu_mul_fp8(gate_up, q, scale, stride_in, n, min_amax, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    g = tl.load(gate_up + row * stride_in + cols, mask=mask, other=0.0)
    u = tl.load(gate_up + row * stride_in + n + cols, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)  # F.silu rounds to the dtype before the product
    y = (act.to(tl.float32) * u.to(tl.float32)).to(g.dtype)
    _quantize_row_into(y, q + row * n, scale, row, cols, mask, min_amax, 448.0)


def silu_mul_fp8(gate_up: torch.Tensor, min_amax: float):
    """triton_ops.silu_mul's output, silu(gate) * up of gate_up [T, 2I], as (float8 [T, I], fp32 [T, 1])."""
    rows, width = gate_up.shape
    n = width // 2
    q = torch.empty(rows, n, dtype=torch.float8_e4m3fn, device=gate_up.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=gate_up.device)
    if rows:
        assert gate_up.stride(1) == 1
        block = triton.next_power_of_2(n)
        # NOTE the whole row in one program (its amax): 16 warps hold Llama-8B's 14336 at 32 a thread.
        _silu_mul_fp8[(rows,)](
            gate_up, q, scale, gate_up.stride(0), n, min_amax, BLOCK=block, num_warps=16 if block >= 8192 else 8
        )
    return q, scale


# gate_up_silu_fp8: the gate_up GEMM, silu-and-multiply and the down_proj input's quantization in two
# launches where fp8_gemm + silu_mul_fp8 took two with a [T, 2I] round trip between them, and
# silu_mul_fp8 ran one program a row (64 programs at batch 64: 7.2 us a layer, H100). Each GEMM
# program computes the gate rows and the matching up rows of its tile (two accumulators on one x
# tile), rounds both as fp8_gemm would, applies silu * up as silu_mul does, writes the product and
# its per-token amax over the tile; the second kernel takes each row's max of those and quantizes.
# Same bits as the two kernels it replaces (tests/gpu/test_fp8_cuda.py).


@triton.jit
def _gate_up_silu_tma(
    w_desc, x_desc, sw_ptr, sx_ptr, y_ptr, amax_ptr, M, INTER, K: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_ok = offs_n < INTER
    m_ok = offs_m < M
    if PDL:  # as _fp8_gemm_tma
        gdc_launch_dependents()
    # (the up's and the gate's weight scales, then the tokens' once x's writer is done: _epilogue_operands)
    sw_u = tl.load(sw_ptr + INTER + offs_n, mask=n_ok, other=0.0)
    sw_g, sx, _ = _epilogue_operands(pid_n, pid_m, sw_ptr, sx_ptr, sw_ptr, M, INTER, False, BLOCK_N, BLOCK_M, PDL)
    acc_g = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = x_desc.load([pid_m * BLOCK_M, k0]).T
        # NOTE rows past INTER of the gate tile are up's first rows: read, never stored (n_ok).
        acc_g = tl.dot(w_desc.load([pid_n * BLOCK_N, k0]), x, acc_g)
        acc_u = tl.dot(w_desc.load([INTER + pid_n * BLOCK_N, k0]), x, acc_u)
    dtype = y_ptr.dtype.element_ty
    # fp8_gemm's epilogue, (acc * sx) * sw rounded to the model dtype, then silu_mul's arithmetic.
    gate = (acc_g * sx[None, :] * sw_g[:, None]).to(dtype).to(tl.float32)
    up = (acc_u * sx[None, :] * sw_u[:, None]).to(dtype).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype)
    y = (act.to(tl.float32) * up).to(dtype)
    ok = n_ok[:, None] & m_ok[None, :]
    tl.store(y_ptr + offs_m[None, :] * INTER + offs_n[:, None], y, mask=ok)
    tl.store(amax_ptr + pid_n * M + offs_m, tl.max(tl.where(ok, tl.abs(y.to(tl.float32)), 0.0), axis=0), mask=m_ok)


@triton.jit
def _quantize_rows_by_amax(
    y_ptr, amax_ptr, q_ptr, scale_ptr, M, cols, tiles, min_amax, fp8_max, BLOCK: tl.constexpr, BLOCK_T: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    t = tl.arange(0, BLOCK_T)
    amax = tl.max(tl.load(amax_ptr + t * M + row, mask=t < tiles, other=0.0), axis=0)
    scale = tl.maximum(amax, min_amax) / fp8_max  # _quantize_rows' numbers from here on
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < cols
    y = tl.load(y_ptr + row * cols + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(q_ptr + row * cols + offs, tl.math.div_rn(y, tl.zeros_like(y) + scale).to(tl.float8e4nv), mask=mask)
    if chunk == 0:
        tl.store(scale_ptr + row, scale)


def gate_up_silu_fp8(xq, x_scale, weight, weight_scale, dtype, min_amax: float, block_k: int = 128):
    """silu(gate) * up of the FP8 layer weight [2I, K] = [gate; up] (no bias) on xq [M, K] * x_scale,
    quantized per token: silu_mul_fp8(fp8_gemm(xq, x_scale, weight, weight_scale, None, dtype)) in
    two launches, as (float8 [M, I], fp32 [M, 1]). TMA-describable operands only (tma_describable)."""
    m, k = xq.shape
    i = weight.shape[0] // 2
    block_n, block_m = 64, max(16, min(128, triton.next_power_of_2(m)))
    tiles = triton.cdiv(i, block_n)
    q = torch.empty(m, i, dtype=torch.float8_e4m3fn, device=xq.device)
    scale = torch.empty(m, 1, dtype=torch.float32, device=xq.device)
    if m == 0:
        return q, scale
    y = torch.empty(m, i, dtype=dtype, device=xq.device)
    amax = torch.empty(tiles, m, dtype=torch.float32, device=xq.device)
    w_desc = TensorDescriptor.from_tensor(weight, [block_n, block_k])
    x_desc = TensorDescriptor.from_tensor(xq, [block_m, block_k])
    # Tiles: the best of an H100 sweep at Llama-8B's gate_up, 64 and 128 tokens (64-row gate and up
    # tiles, K 128 at a time, 3 in flight: 50.2 and 55.2 us with the quantization, against 53.1 and 58.9).
    _gate_up_silu_tma[(tiles, triton.cdiv(m, block_m))](
        w_desc, x_desc, weight_scale, x_scale, y, amax, m, i, K=k, BLOCK_N=block_n, BLOCK_M=block_m, BLOCK_K=block_k,
        PDL=pdl(xq.device), launch_pdl=pdl(xq.device), num_stages=3, num_warps=4,
    )  # fmt: skip
    block = 1024
    _quantize_rows_by_amax[(m, triton.cdiv(i, block))](
        y, amax, q, scale, m, i, tiles, min_amax, 448.0, BLOCK=block, BLOCK_T=triton.next_power_of_2(tiles),
        PDL=pdl(xq.device), launch_pdl=pdl(xq.device), num_warps=4,
    )  # fmt: skip
    return q, scale
