"""Timing only: make kernels of the FP8 decode path launch nothing, to measure what the step would
take if their work cost nothing (a perfect fusion into the kernels around them). The model's numbers
are garbage then; only the step's time means anything.

    small      the FP8 layer's small kernels: all four below
    norms      rmsnorm_fp8, both of a layer's (their float8 output left unwritten; fp8_kernels.py)
    rope       rope_store_kv (attention/triton_store.py)
    quantize   quantize_per_token (o_proj's input) and the fused gate_up's quantization
    ksum       down_proj's K-split sum (fp8_kernels._sum_partials)
    attention  the decode attention (attention/triton_decode.py)

`bench.micro.decode_step --drop-kernels small [attention]` calls `drop` before it builds the engine
(the CUDA graphs then capture the GEMMs, the attention and the head alone).
"""

from __future__ import annotations

import torch

CHOICES = ("small", "norms", "rope", "quantize", "ksum", "attention")


class _NoLaunch:
    """Stands for a Triton kernel: `kernel[grid](...)` launches nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def _unwritten_fp8_rows(rows: int, cols: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    # torch.empty launches no kernel (a fill would be one)
    return (
        torch.empty(rows, cols, dtype=torch.float8_e4m3fn, device=device),
        torch.empty(rows, 1, dtype=torch.float32, device=device),
    )


def drop(kinds: list[str]) -> None:
    """Replace the kernels of `kinds` (CHOICES) for the rest of the process."""
    from pdserve.common.engine.attention import triton_backend
    from pdserve.common.engine.models import fp8_kernels

    kinds = set(kinds) | ({"norms", "rope", "quantize", "ksum"} if "small" in kinds else set())
    if "norms" in kinds:
        fp8_kernels.rmsnorm_fp8 = lambda x, weight, eps, residual, min_amax: _unwritten_fp8_rows(*x.shape, x.device)
    if "rope" in kinds:
        triton_backend.rope_store_kv = lambda *args, **kwargs: None
    if "quantize" in kinds:
        fp8_kernels.quantize_per_token = lambda x, min_amax: _unwritten_fp8_rows(*x.shape, x.device)
        fp8_kernels._quantize_rows_by_amax = _NoLaunch()
    if "ksum" in kinds:
        fp8_kernels._sum_partials = _NoLaunch()
    if "attention" in kinds:
        triton_backend.decode_attention = lambda *args, **kwargs: None
