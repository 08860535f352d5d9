"""Block-wise FP8 linear layers' kernels, for CUDA (imported on first use, as fp8_kernels is):

    quantize_per_token_group(x, group, min_amax)       fp8_block.quantize_per_token_group as one launch
    block_fp8_gemm(xq, sx, w, sw, block, bias, dtype)  the block-scaled FP8 GEMM (fp8_block.py's numbers)

Both take shapes and pointers only (no host sync, no data-dependent shape): they run inside captured
CUDA graphs. The GEMM follows fp8_kernels.fp8_gemm's swapped tiles (each program a [BLOCK_N, BLOCK_M]
tile of the output's transpose: with few tokens the weight's rows fill the MMA's M side) and reads
its tiles by pointer; its K step is one scale group (block_k), so each step's partial sums take their
weight and activation scales before joining the fp32 accumulator.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from pdserve.common.engine.attention.triton_store import _round_to_e4m3
from pdserve.common.engine.models import fp8_kernels


@triton.jit
def _quantize_groups(
    x_ptr, q_ptr, scale_ptr, K, groups, x_row_stride, min_amax, fp8_max, GROUP: tl.constexpr, PDL: tl.constexpr
):  # fmt: skip
    if PDL:  # (common/engine/pdl.py)
        gdc_launch_dependents()
        gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    offs = group * GROUP + tl.arange(0, GROUP)
    mask = offs < K
    x = tl.load(x_ptr + row * x_row_stride + offs, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=0), min_amax) / fp8_max
    # NOTE: rounded to e4m3 in fp32 first (triton_store._round_to_e4m3): Triton 3.6's interpreter,
    # which runs this in the CPU tests, drops the carry of its own fp32 -> float8 cast. Its
    # subnormal rounding turns a negative value that rounds to zero into +0; torch's cast keeps -0.
    scaled = tl.math.div_rn(x, tl.zeros([GROUP], tl.float32) + scale)
    rounded = _round_to_e4m3(scaled)
    q = tl.where(rounded == 0.0, scaled * 0.0, rounded)
    tl.store(q_ptr + row * K + offs, q.to(tl.float8e4nv), mask=mask)
    tl.store(scale_ptr + row * groups + group, scale)


def quantize_per_token_group(x: torch.Tensor, group: int, min_amax: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(xq float8_e4m3fn [M, K], sx fp32 [M, ceil(K / group)]) of a 2-D tensor: the bits of
    fp8_block.quantize_per_token_group (which passes `min_amax`: this module imports nothing of it)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows, k = x.shape
    groups = triton.cdiv(k, group)
    q = torch.empty(rows, k, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(rows, groups, dtype=torch.float32, device=x.device)
    if rows:
        pdl = fp8_kernels.pdl(x.device)
        _quantize_groups[(rows, groups)](
            x, q, scale, k, groups, x.stride(0), min_amax, 448.0, GROUP=group, PDL=pdl, launch_pdl=pdl,
            num_warps=1 if group <= 128 else 2,
        )  # fmt: skip
    return q, scale


@triton.jit
def _block_fp8_gemm(
    w_ptr, x_ptr, sw_ptr, sx_ptr, bias_ptr, out_ptr, M, N, w_row_stride, x_row_stride, out_row_stride,
    sw_row_stride, sx_row_stride, K: tl.constexpr, SCALE_ROWS: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """out[m, n] = sum over K groups of (w[n, group] . x[m, group]) * sw[n // SCALE_ROWS, group] *
    sx[m, group], + bias[n], rounded once. BLOCK_K is the scale group (block_k). With SPLIT_K > 1,
    program k of the third grid axis sums its share of the groups, scaled, into out_ptr's fp32
    partials [SPLIT_K, M, N] (no bias): fp8_kernels._sum_partials adds them."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    groups: tl.constexpr = (K + BLOCK_K - 1) // BLOCK_K
    per_split: tl.constexpr = (groups + SPLIT_K - 1) // SPLIT_K
    first = pid_k * per_split
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    m_ok = offs_m < M
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * w_row_stride + first * BLOCK_K + offs_k[None, :]
    x_ptrs = x_ptr + offs_m.to(tl.int64)[None, :] * x_row_stride + first * BLOCK_K + offs_k[:, None]
    sw_ptrs = sw_ptr + (offs_n // SCALE_ROWS) * sw_row_stride
    sx_ptrs = sx_ptr + offs_m * sx_row_stride
    if PDL:
        gdc_launch_dependents()
        gdc_wait()  # launched before the kernel that wrote x had finished (common/engine/pdl.py)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    # K is a constexpr (a model has a few): a known trip count pipelines.
    for step in range(0, per_split):
        group = first + step
        k_ok = group * BLOCK_K + offs_k < K
        w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(x_ptrs, mask=m_ok[None, :] & k_ok[:, None], other=0.0)
        # (a last split may hold fewer groups: its scales past the last group read as 0)
        sw = tl.load(sw_ptrs + group, mask=n_ok & (group < groups), other=0.0)
        sx = tl.load(sx_ptrs + group, mask=m_ok & (group < groups), other=0.0)
        # NOTE: a fresh dot per group (not tl.dot(w, x, acc)): the group's sums must take their own
        # scales before they join the others.
        acc += tl.dot(w, x) * sw[:, None] * sx[None, :]
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if SPLIT_K > 1:
        partial = out_ptr + (pid_k * M + offs_m.to(tl.int64))[None, :] * N + offs_n[:, None]
        tl.store(partial, acc, mask=n_ok[:, None] & m_ok[None, :])
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        out_ptrs = out_ptr + offs_m.to(tl.int64)[None, :] * out_row_stride + offs_n[:, None]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])


SPLIT_PROGRAMS = 256  # K is split until the decode-size grid has about this many programs (~2 per SM)


def gemm_config(m: int, n: int, k: int, block_k: int) -> dict:
    """Tiles of block_fp8_gemm for m tokens and an [n, k] weight in scale groups of block_k: 64
    weight rows a program up to 128 tokens (decode: the weight is read once per 128 tokens), K split
    where that leaves the GPU short of programs (Llama-8B: o_proj and down_proj in 4, qkv in 2; gate_up
    has 448 tiles of rows), 128 x 128 tiles above 128 tokens (prefill). Not swept on a GPU yet.

    NOTE the split depends on the weight's shape only, never on m: a CUDA graph's padded batch and
    the eager batch then sum in the same order (the graph-vs-eager token tests rely on it)."""
    if m > 128:
        return {"BLOCK_N": 128, "BLOCK_M": 128, "SPLIT_K": 1, "num_stages": 3, "num_warps": 8}
    row_tiles, groups = triton.cdiv(n, 64), triton.cdiv(k, block_k)
    split = max(1, min(4, SPLIT_PROGRAMS // row_tiles, groups // 4))
    block_m = max(16, triton.next_power_of_2(m))
    return {"BLOCK_N": 64, "BLOCK_M": block_m, "SPLIT_K": split, "num_stages": 4, "num_warps": 4}


def block_fp8_gemm(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    block: tuple[int, int],
    bias: torch.Tensor | None,
    dtype,
    config: dict | None = None,
) -> torch.Tensor:
    """xq [M, K] (float8, its scales x_scale [M, ceil(K / block_k)]) times weight [N, K] (float8, its
    block scales weight_scale [ceil(N / block_n), ceil(K / block_k)]) transposed, + bias [N], in
    `dtype`: fp8_block.emulated_block_fp8_mm's numbers up to the order of the fp32 sums. One launch, two
    with a K split (gemm_config)."""
    m, k = xq.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=dtype, device=xq.device)
    if m == 0:
        return out
    assert xq.stride(1) == 1 and weight.stride(1) == 1 and x_scale.stride(1) == 1 and weight_scale.stride(1) == 1
    cfg = dict(config or gemm_config(m, n, k, block[1]))
    cfg.setdefault("SPLIT_K", 1)
    split = cfg["SPLIT_K"]
    grid = (triton.cdiv(n, cfg["BLOCK_N"]), triton.cdiv(m, cfg["BLOCK_M"]), split)
    pdl = fp8_kernels.pdl(xq.device)
    # With a split, the GEMM writes fp32 partials [split, m, n] (scaled, no bias), then one add.
    target = torch.empty(split, m, n, dtype=torch.float32, device=xq.device) if split > 1 else out
    _block_fp8_gemm[grid](
        weight, xq, weight_scale, x_scale, bias if bias is not None else weight_scale, target, m, n, weight.stride(0),
        xq.stride(0), out.stride(0), weight_scale.stride(0), x_scale.stride(0), K=k, SCALE_ROWS=block[0],
        HAS_BIAS=bias is not None, BLOCK_K=block[1], PDL=pdl, launch_pdl=pdl, **cfg,
    )  # fmt: skip
    if split > 1:  # (out is fresh: its rows are contiguous, as _sum_partials writes them)
        add = min(1024, triton.next_power_of_2(n))
        fp8_kernels._sum_partials[(m, triton.cdiv(n, add))](
            target, target, target, bias if bias is not None else target, out, m, n, SPLIT_K=split,
            HAS_BIAS=bias is not None, BLOCK=add, PDL=pdl, launch_pdl=pdl, SCALED=False,
        )  # fmt: skip
    return out
