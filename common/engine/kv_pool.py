"""The two-level KV memory: ReqToTokenPool (request row, position -> slot) and the paged KV pool.

    ReqToTokenPool.req_to_token  [max_reqs, context_len] int32, on the device
        row r, column p  = the KV slot holding position p of the request that owns row r
    PagedKVPool.k_buffers[l], v_buffers[l]  [num_pages * page_size, kv_heads, head_dim]
        slot s lives in page s // page_size; pages are the unit of allocation, of prefix caching
        and of NIXL transfer. In memory each layer is head-major (k_storage[l]: [kv_heads, slots,
        head_dim], contiguous; k_buffers[l] is its transposed view), so a run of pages of one head
        is one contiguous range: a KV transfer between servers of different TP sizes moves head
        slices of pages as one descriptor per (layer, K/V, head, run of pages). The kernels and
        the torch reference address the pool through its strides and never notice.

Page 0 is never handed out: its slots are the dummy write target for padded positions (CUDA-graph
padding), so a padded write can never land in a live request's KV.

Allocation is host-side bookkeeping only (free lists); the device tensors are written by the
forward pass (KV) and by the batch builder (req_to_token), both in stream order.
"""

from __future__ import annotations

from collections import deque

import torch


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
        shape = (kv_heads, num_pages * page_size, head_dim)
        # NOTE: the storages are what a transfer agent registers (contiguous); everything else
        # uses the [slots, kv_heads, head_dim] views.
        self.k_storage = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_storage = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.k_buffers = [b.transpose(0, 1) for b in self.k_storage]
        self.v_buffers = [b.transpose(0, 1) for b in self.v_storage]
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

    def set_kv(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the new tokens' K and V at slots `loc` ([T] int64) of one layer."""
        self.k_buffers[layer][loc] = k.to(self.dtype)
        self.v_buffers[layer][loc] = v.to(self.dtype)
