"""The two-level KV memory: ReqToTokenPool (request row, position -> slot) and the paged KV pool.

    ReqToTokenPool.req_to_token  [max_reqs, context_len] int32, on the device
        row r, column p  = the KV slot holding position p of the request that owns row r
    PagedKVPool.k_buffers[l], v_buffers[l]  [num_pages * page_size, kv_heads, head_dim]
        slot s lives in page s // page_size; pages are the unit of allocation, of prefix caching
        and of KV transfer. Each layer's K (and V) is token-major and contiguous (k_storage[l] is
        k_buffers[l]), so a page of every head is one contiguous range, and a run of pages one
        range too: a KV transfer moves a request as one descriptor per (layer, K/V, page run).
        (Servers of different TP sizes move head slices: a row of head_dim x heads per token.)
        The kernels and the torch reference address the pool through its strides.

With an FP8 KV cache (`--kv-cache-dtype fp8_e4m3`) the buffers are float8_e4m3fn and each layer has
one fp32 scale for K and one for V (`k_scales[l]`, `v_scales[l]`): stored = value / scale, rounded to
float8 (clamped to +-448 first: torch's cast turns out-of-range values into NaN where the GPU's
saturates); read = float8 * scale. The scales are device tensors that the kernels load, so a CUDA
graph captured before they are set still reads the set values.

Page 0 is never handed out: its slots are the dummy write target for padded positions (CUDA-graph
padding), so a padded write can never land in a live request's KV.

Allocation is host-side bookkeeping only (free lists); the device tensors are written by the
forward pass (KV) and by the batch builder (req_to_token), both in stream order.
"""

from __future__ import annotations

import math
import mmap
from collections import deque

import torch

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value


def quantize_kv(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale rounded to float8_e4m3fn, saturating at +-448 (the Triton store kernels' numbers)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_KV_DTYPE)


class ReqToTokenPool:
    """Rows of the position -> slot table, one per live request.

    One extra row, `pad_row`, is never handed out and stays all zeros (slot 0, in the reserved
    page 0): the padded rows of a CUDA-graph batch point at it, so they read and write only page 0.
    """

    def __init__(self, size: int, context_len: int, device: torch.device | str):
        self.size = size
        self.context_len = context_len
        self.pad_row = size
        self.req_to_token = torch.zeros((size + 1, context_len), dtype=torch.int32, device=device)
        self._free_rows: deque[int] = deque(range(size))

    def available(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> int | None:
        return self._free_rows.popleft() if self._free_rows else None

    def free(self, row: int) -> None:
        assert 0 <= row < self.size, row
        self._free_rows.append(row)

    def write_slots(self, rows: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """req_to_token[rows[i], positions[i]] = slots[i]: the one device write to this table, made
        by the batch builder on the schedule stream (no host sync)."""
        self.req_to_token[rows, positions] = slots.to(torch.int32)


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """torch.zeros, but on CPU an anonymous memory map: the kernel's zero pages, faulted in as the pool
    is first written, instead of a pool's worth of zeros written at start-up (SmolLM2's 1 GiB CPU pool:
    0.8-1.2 s of each server's start on 2 cores). The tensor keeps the map alive."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    count = math.prod(shape)
    if count == 0:
        return torch.zeros(shape, dtype=dtype)
    return torch.frombuffer(mmap.mmap(-1, count * dtype.itemsize), dtype=dtype).view(shape)


class PagedKVPool:
    """Per-layer K and V buffers addressed by slot, handed out a page at a time."""

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        head_start: int = 0,
        model_kv_heads: int = 0,
    ):
        """`head_start`: the model's first KV head this pool holds (a TP rank holds heads
        [head_start, head_start + kv_heads) of `model_kv_heads`; 0: all of them, kv_heads)."""
        if num_pages < 2:
            raise ValueError(f"the KV pool needs at least 2 pages (page 0 is reserved), got {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_layers = num_layers
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.head_start = head_start
        self.model_kv_heads = model_kv_heads or kv_heads
        if not 0 <= head_start <= self.model_kv_heads - kv_heads:
            raise ValueError(
                f"KV heads [{head_start}, {head_start + kv_heads}) are not heads of a model with {self.model_kv_heads}"
            )
        shape = (num_pages * page_size, kv_heads, head_dim)
        # NOTE: the storages are what a transfer agent registers (contiguous); the kernels use the
        # same tensors as k_buffers / v_buffers.
        self.k_storage = [zeroed(shape, dtype, device) for _ in range(num_layers)]
        self.v_storage = [zeroed(shape, dtype, device) for _ in range(num_layers)]
        self.k_buffers = self.k_storage
        self.v_buffers = self.v_storage
        # One scale per layer for K and for V; 1.0 (and never read) unless the pool is float8.
        self.k_scales = torch.ones(num_layers, dtype=torch.float32, device=device)
        self.v_scales = torch.ones(num_layers, dtype=torch.float32, device=device)
        self.scales_set = False
        self._free_pages: deque[int] = deque(range(1, num_pages))
        # The prefix cache's host tier (engine/host_kv_pool.HostKVPool), set by the engine with
        # --host-kv-cache-gb: kept here, beside the pages it backs, for the scheduler to find.
        self.host_tier = None

    @property
    def capacity_pages(self) -> int:
        """Pages that can ever be allocated (page 0 excluded)."""
        return self.num_pages - 1

    @property
    def capacity_tokens(self) -> int:
        return self.capacity_pages * self.page_size

    def num_free_pages(self) -> int:
        return len(self._free_pages)

    def used_tokens(self) -> int:
        return (self.capacity_pages - len(self._free_pages)) * self.page_size

    def alloc_pages(self, n: int) -> list[int] | None:
        """n pages, or None (and nothing taken) when fewer are free."""
        if n > len(self._free_pages):
            return None
        return [self._free_pages.popleft() for _ in range(n)]

    def free_pages(self, pages: list[int]) -> None:
        for page in pages:
            assert 0 < page < self.num_pages, page
        self._free_pages.extend(pages)

    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.kv_heads * self.head_dim * self.k_buffers[0].element_size()

    @property
    def quantized(self) -> bool:
        """Whether K and V are stored in float8 with per-layer scales."""
        return self.dtype == FP8_KV_DTYPE

    def set_scales(self, k_scales: torch.Tensor, v_scales: torch.Tensor) -> None:
        """Every layer's K and V scales ([num_layers] each, positive), written in place: kernels and
        captured graphs hold these tensors."""
        assert k_scales.shape == v_scales.shape == (self.num_layers,), (k_scales.shape, v_scales.shape)
        if not (bool((k_scales > 0).all()) and bool((v_scales > 0).all())):
            raise ValueError("KV cache scales must be positive")
        self.k_scales.copy_(k_scales)
        self.v_scales.copy_(v_scales)
        self.scales_set = True

    def layer_scales(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's K and V scales as 1-element device views (what the Triton kernels load)."""
        return self.k_scales[layer : layer + 1], self.v_scales[layer : layer + 1]

    def set_kv(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the new tokens' K and V at slots `loc` ([T] int64) of one layer."""
        if self.quantized:
            self.k_buffers[layer][loc] = quantize_kv(k, self.k_scales[layer])
            self.v_buffers[layer][loc] = quantize_kv(v, self.v_scales[layer])
            return
        self.k_buffers[layer][loc] = k.to(self.dtype)
        self.v_buffers[layer][loc] = v.to(self.dtype)

    def read_kv(self, layer: int, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at `slots` (any shape of indices) of one layer, in `dtype` (dequantized: float8 in
        fp32 times the layer's scale, then rounded to `dtype`)."""
        k, v = self.k_buffers[layer][slots], self.v_buffers[layer][slots]
        if self.quantized:
            return (k.float() * self.k_scales[layer]).to(dtype), (v.float() * self.v_scales[layer]).to(dtype)
        return k.to(dtype), v.to(dtype)
