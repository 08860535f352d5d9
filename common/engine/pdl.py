"""Programmatic dependent launch (PDL, Hopper): a kernel launched with `launch_pdl=enabled(device)`
may start before the kernel before it has finished.

The contract, for every kernel launched so: it calls `gdc_launch_dependents()` (the next may
launch once all of this one's programs run) and then `gdc_wait()` (wait for the one before to
finish and its writes to be visible) before it writes anything or reads anything a kernel launched
so may have written (`if PDL:` near the top of the kernel, PDL its constexpr). NOTE: a kernel
launched so may start while kernels further back than the one before still run (each lets the
next launch as it starts), so nothing such a kernel writes is safe to read before the wait. What
none of them writes may be read before it, so those loads' latency overlaps the kernel before: a
layer's weights and their scales, a norm's weight, a bias (set at load), and a forward's metadata
(lengths, positions, slots, pool rows: copied in, or computed by torch ops, which never launch
early, so they are complete before the first kernel launched so after them starts; read past L1,
`cache_modifier=".cg"`, so no line a kernel before left on the SM answers for them). Where:
fp8_kernels.py `_epilogue_operands`, `_rmsnorm_fp8`; triton_store.py's rope-store (cos, sin, slot);
triton_decode.py's decode attention (lengths, rows).

A kernel's ramp (its launch and its first loads' latency, ~1-2 us) then overlaps the tail of the
one before. A kernel launched so after one that never signals (cuBLAS) starts when that one's
programs have all exited, as without PDL.

Launched so: the FP8 decode path's kernels (fp8_kernels.py: the GEMMs, the K split's sum,
rmsnorm_fp8, quantize_per_token, the fused gate_up and its quantization), rope_store_kv and the
decode attention (attention/triton_store.py, attention/triton_decode.py). Measured in
docs/benchmarks/fp8.md, "FP8 decode step, third pass" and "fourth pass": the FP8 path's kernels 2% of
a Llama-8B step at batch 64, rope_store_kv and the attention 0.7% more (H100). Prefetching the
weight to L2 before the wait made the step slower.

NOTE a profiler's kernel times under PDL include the time a kernel spent launched and waiting:
compare steps, not kernels.
"""

from __future__ import annotations

import functools

import torch
import triton

# Off: every kernel launches and runs as without PDL (the benchmarks' comparison).
ENABLED = True


@triton.jit
def _probe():
    pass


# True when TRITON_INTERPRET was set as the kernels were defined (the CPU tests): no PDL there.
_INTERPRETED = not isinstance(_probe, triton.runtime.JITFunction)


def enabled(device: torch.device) -> bool:
    """PDL on for launches on this device: Hopper and later, never under the interpreter."""
    return ENABLED and not _INTERPRETED and _hopper(device)


@functools.lru_cache(maxsize=None)
def _hopper(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)
