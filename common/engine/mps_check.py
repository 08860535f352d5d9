"""A start-up check of the GPU's GEMMs for a server that runs on part of the GPU under MPS.

Why: on an H200 (driver 580.159.04, torch 2.11 + CUDA 13's cuBLAS), bf16 GEMMs at Llama-1B's projection
shapes came out wrong under an MPS daemon at CUDA_MPS_ACTIVE_THREAD_PERCENTAGE 60, 70 and 80 — errors
as large as the results, mostly different from one run to the next (15-41 of 60 GEMMs per share) — and
right at 50, 90 and 100 (docs/benchmarks/one-gpu.md, "GEMMs under MPS SM shares"). Nothing fails loudly: the
server would serve wrong tokens. So a server given a share below 100% checks before it serves: each of
its model's linear shapes at a few token counts, run twice (the same bits) and checked against an fp32
reference on the CPU through a random projection (Freivalds: y @ v against x @ (W^T v), every row at
once, cheap on the CPU). A failure stops the start with the share named.
"""

from __future__ import annotations

import os

import torch
from torch import nn

ENV = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
TOKENS = (64, 128, 256, 512)
MAX_SHAPES = 6
TOLERANCE = 2e-2  # relative, of the projected rows; a bf16 GEMM's rounding is ~1e-3 of it


def linear_shapes(model: nn.Module) -> list[tuple[int, int]]:
    """(in, out) of the model's distinct linear layers (nn.Linear and FP8 ones: anything with in and out
    features), the largest first (at most MAX_SHAPES)."""
    shapes = {(m.in_features, m.out_features) for m in model.modules() if hasattr(m, "in_features")}
    return sorted(shapes, key=lambda s: -s[0] * s[1])[:MAX_SHAPES]


def gemm_failures(shapes, dtype: torch.dtype, device, matmul=torch.nn.functional.linear, tokens=TOKENS) -> list[str]:
    """What went wrong computing x @ W^T by `matmul` on `device` at these shapes: one line per GEMM
    whose two runs differ or whose result is off the fp32 reference by more than TOLERANCE."""
    gen = torch.Generator().manual_seed(0)
    failures = []
    for k, n in shapes:
        w = (torch.randn(n, k, generator=gen) * k**-0.5).to(dtype)
        v = torch.randn(n, generator=gen)
        w_v = w.float().t() @ v  # [k]
        w_device = w.to(device)
        for m in tokens:
            x = torch.randn(m, k, generator=gen).to(dtype)
            x_device = x.to(device)
            first, second = matmul(x_device, w_device), matmul(x_device, w_device)
            want = x.float() @ w_v
            got = first.float().cpu() @ v
            error = ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()
            repeat = torch.equal(first, second)
            if error > TOLERANCE or not repeat:
                failures.append(f"[{m}, {k}] x [{k}, {n}]: off by {error:.0%}{'' if repeat else ', two runs differ'}")
    return failures


def check_gemms_under_mps(model: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """RuntimeError when this process runs under an MPS SM share below 100% and the GPU's GEMMs at the
    model's shapes are wrong there; nothing otherwise (and nothing off a GPU or without a share)."""
    share = os.environ.get(ENV)
    if device.type != "cuda" or not share or float(share) >= 100:
        return
    failures = gemm_failures(linear_shapes(model), dtype, device)
    if failures:
        raise RuntimeError(
            f"under MPS at an SM share of {share}% this GPU's GEMMs give wrong results at this model's shapes "
            f"({len(failures)} failed: {'; '.join(failures[:3])}): start with another --sm-shares value "
            "(50 and 100 were right on an H200), or without MPS"
        )
