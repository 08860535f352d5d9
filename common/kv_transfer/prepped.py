"""A pool as one NIXL prepared descriptor list, and a request's pages as indices into it.

NIXL can prepare a descriptor list once (`prep_xfer_dlist`) and build each transfer from indices
into it (`make_prepped_xfer`), in C++ with the GIL released, merging indices consecutive on both
sides into one descriptor: no per-request descriptor lists built in Python, no per-request checks
of them against the registered memory (vLLM's and SGLang's NIXL connectors do the same).

Descriptor (layer l, K=0/V=1 kv, page p) of a token-major pool (common/engine/kv_pool.py) of P
pages is index (l * 2 + kv) * P + p: a whole page, every head the pool holds. Each (l, kv) is one
strided row of the prepared list (NIXL's Nx5 form: P pages back to back), so the list is
2 x layers rows whatever the pool's size. A request's pages, listed in the same (l, kv, page)
order on both sides, pair index i of the source with index i of the destination; a run of pages
contiguous on both sides becomes one descriptor: 2 x layers x runs per request. (WRITEs of head
slices, between servers of different TP sizes, are built from address lists: pages.run_descriptors.)
"""

from __future__ import annotations

import functools

import numpy as np

from pdserve.common.kv_transfer.base import KVLayout

# make_prepped_xfer takes 32-bit indices: a pool with more pages than this allows is not prepared
# (its WRITEs are built from address lists).
MAX_INDEX = 2**31 - 1


def preparable(layout: KVLayout) -> bool:
    """Whether every (layer, K/V, page) of the pool has an index make_prepped_xfer takes."""
    return 2 * layout.num_layers * layout.num_pages - 1 <= MAX_INDEX


def strided_rows(k_addrs, v_addrs, layout: KVLayout, device_id: int) -> np.ndarray:
    """The Nx5 rows (address, length, device id, stride, count) of a pool's prepared list: one per
    (layer, K then V), each the buffer's every page."""
    size = layout.page_bytes
    rows = []
    for k_base, v_base in zip(k_addrs, v_addrs, strict=True):
        for base in (k_base, v_base):
            rows.append((base, size, device_id, size, layout.num_pages))
    return np.array(rows, dtype=np.uint64)


def page_indices(layout: KVLayout, pages: list[int]) -> np.ndarray:
    """The prepared-list indices of `pages` in (layer, K/V, page) order: equal-length lists of the
    two sides pair up index for index."""
    return (_buffer_starts(layout.num_layers, layout.num_pages) + np.array(pages, dtype=np.int32)).reshape(-1)


@functools.lru_cache(maxsize=16)
def _buffer_starts(num_layers: int, num_pages: int) -> np.ndarray:
    """Each (layer, K/V) row's first index, as a column (int32: preparable() bounds every index)."""
    return (np.arange(2 * num_layers, dtype=np.int64)[:, None] * num_pages).astype(np.int32)
