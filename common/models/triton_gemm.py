"""Triton GEMM for the decode step's small-M projections: y = x @ W^T (+ bias), split over K.

At decode, M is the batch (1-256 rows) and every projection is a weight stream: the time should be
the weight bytes over the memory bandwidth. cuBLAS picks tiles for throughput, so at M = 128 a
Llama-1B qkv projection (3072 x 2048) runs as 24 CTAs on 132 SMs and reads its weights at about
1.3-2 TB/s. Here the grid is widened by splitting K instead of narrowing N: narrow N tiles would
make every CTA re-read the whole activation block from L2, while K splits read each activation
element once per N tile.

Split-K partials meet in a small fp32 workspace. Each split writes its tile, then takes a ticket
on the tile's semaphore; the split that takes the last ticket sums the partials in split order
(so the result does not depend on which split finished last: deterministic, run to run), adds the
bias, rounds once to the output dtype, and resets the semaphore for the next call. No split ever
waits for another, so there is no deadlock whatever the scheduling. One launch per GEMM, graph-safe.

Used only for bf16/fp16 activations with M <= MAX_M on CUDA (the decode batches CUDA graphs
capture); fp32 and prefill-sized GEMMs stay on cuBLAS (fp32 greedy parity with transformers is
bit-exact only with the same GEMM library).

NOTE: import lazily (layers.py does): Triton reads TRITON_INTERPRET when a kernel is defined.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

MAX_M = 256  # larger M (prefill chunks) is compute-bound: cuBLAS's home ground
MAX_SPLIT_K = 16


@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 4


@triton.jit
def _linear_kernel(
    x, w, bias, out, partials, semaphores,
    M, N, K, stride_x, stride_w, stride_o,
    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, K_ITERS: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    k_start = pid_k * (K_ITERS * BLOCK_K)
    # Rows past M / N read row 0 (always valid) instead of masking: the weight stream stays unmasked.
    rows = tl.where(m_mask, offs_m, 0).to(tl.int64)
    cols = tl.where(n_mask, offs_n, 0).to(tl.int64)
    x_ptrs = x + rows[:, None] * stride_x + (k_start + offs_k)[None, :]
    w_ptrs = w + cols[None, :] * stride_w + (k_start + offs_k)[:, None]  # [BLOCK_K, BLOCK_N] of W^T
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in range(K_ITERS):
        if EVEN_K:
            a = tl.load(x_ptrs)
            b = tl.load(w_ptrs, eviction_policy="evict_first")
        else:
            k_mask = (k_start + i * BLOCK_K + offs_k) < K
            a = tl.load(x_ptrs, mask=k_mask[None, :], other=0.0)
            b = tl.load(w_ptrs, mask=k_mask[:, None], other=0.0, eviction_policy="evict_first")
        acc = tl.dot(a, b, acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    out_ptrs = out + offs_m[:, None].to(tl.int64) * stride_o + offs_n[None, :]
    out_mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptrs, acc.to(out.dtype.element_ty), mask=out_mask)
    else:
        tile = pid_m * tl.num_programs(0) + pid_n
        tile_offs = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        part = partials + tile.to(tl.int64) * (SPLIT_K * BLOCK_M * BLOCK_N)
        tl.store(part + pid_k * (BLOCK_M * BLOCK_N) + tile_offs, acc)
        # NOTE: every thread's partial must be visible before the ticket is taken: the CTA barrier
        # orders them before the (single-thread) release of the atomic, which is cumulative.
        tl.debug_barrier()
        ticket = tl.atomic_add(semaphores + tile, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLIT_K - 1:
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in range(SPLIT_K):
                # .cg: read from L2, never from a (non-coherent) L1 line.
                total += tl.load(part + s * (BLOCK_M * BLOCK_N) + tile_offs, cache_modifier=".cg")
            if HAS_BIAS:
                total += tl.load(bias + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
            tl.store(out_ptrs, total.to(out.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(semaphores + tile, 0, sem="relaxed", scope="gpu")


def _block_m(m: int) -> int:
    return 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 else 128


def default_config(m: int, n: int, k: int, num_sms: int) -> GemmConfig:
    """Tiles for a weight-streaming GEMM: 64 columns per CTA, K split until ~2 CTAs per SM.

    Tuned on an H200 with bench/tune_kernels.py (see docs/benchmarks.md).
    """
    block_m = _block_m(m)
    block_n, block_k = 64, 128
    tiles = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
    k_blocks = triton.cdiv(k, block_k)
    split = 1
    while split * 2 <= MAX_SPLIT_K and tiles * split * 2 <= 2 * num_sms and k_blocks >= split * 2 * 2:
        split *= 2
    return GemmConfig(block_m, block_n, block_k, split)


@dataclass
class GemmWorkspace:
    """Split-K scratch for one model's GEMMs, which run one at a time on its forward stream.

    NOTE: two models running concurrently on one GPU must not share a workspace (their semaphores
    and partials would mix): each fused model owns one.
    """

    partials: torch.Tensor  # fp32
    semaphores: torch.Tensor  # int32, zero between GEMMs

    @classmethod
    def create(cls, device, partial_elems: int = 1 << 20, tiles: int = 4096) -> "GemmWorkspace":
        return cls(
            torch.empty(partial_elems, dtype=torch.float32, device=device),
            torch.zeros(tiles, dtype=torch.int32, device=device),
        )


_sm_counts: dict = {}


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (132 assumed elsewhere: the interpreter)."""
    if device.type != "cuda":
        return 132
    if device not in _sm_counts:
        _sm_counts[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _sm_counts[device]


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    workspace: GemmWorkspace,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """x [M, K] (row stride free, contiguous K) @ weight [N, K]^T + bias [N] -> [M, N] in x's dtype."""
    m, k = x.shape
    n = weight.shape[0]
    assert weight.shape[1] == k and weight.stride(1) == 1 and x.stride(1) == 1
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    c = config or default_config(m, n, k, num_sms(x.device))
    k_blocks = triton.cdiv(k, c.block_k)
    k_iters = triton.cdiv(k_blocks, c.split_k)
    split = triton.cdiv(k_blocks, k_iters)  # no empty splits
    grid = (triton.cdiv(n, c.block_n), triton.cdiv(m, c.block_m), split)
    if split > 1:
        tiles = grid[0] * grid[1]
        assert tiles <= workspace.semaphores.numel(), "GemmWorkspace: too many tiles"
        assert tiles * split * c.block_m * c.block_n <= workspace.partials.numel(), "GemmWorkspace: partials too small"
    _linear_kernel[grid](
        x, weight, bias if bias is not None else weight, out, workspace.partials, workspace.semaphores,
        m, n, k, x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, SPLIT_K=split, K_ITERS=k_iters, EVEN_K=k_iters * split * c.block_k == k,
        BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k,
        num_warps=c.num_warps, num_stages=c.num_stages,
    )
    return out


def workspace_size(shapes, max_m: int = MAX_M, num_sms: int = 132) -> tuple[int, int]:
    """(partial elements, tiles) enough for GEMMs of these (N, K) at every M <= max_m."""
    partial, tiles = 0, 0
    for n, k in shapes:
        for m in {1, 16, 32, 64, 128, max_m}:
            if m > max_m:
                continue
            c = default_config(m, n, k, num_sms)
            t = triton.cdiv(n, c.block_n) * triton.cdiv(m, c.block_m)
            tiles = max(tiles, t)
            partial = max(partial, t * c.split_k * c.block_m * c.block_n)
    return partial, tiles
