"""Page lists -> byte-range descriptors: the pure arithmetic under `write_pages`, no transport here.

A descriptor is (address, length, device_id). Pools are token-major (common/engine/kv_pool.py): in
a layer's K (or V) buffer of H local heads, page p is one contiguous range of page_bytes bytes at
p * page_bytes, and within it token t's heads [h0, h1) are one row of (h1 - h0) * head_dim elements
at (t * H + h0) * head_dim. A WRITE of every head of the pool into a pool holding the same heads
moves whole pages (a run of pages is one range); one between servers of different TP sizes moves
head slices: page_size rows a page (`page_rows`).
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.common.kv_transfer.base import KVLayout

Descriptor = tuple[int, int, int]


@dataclass(frozen=True)
class Rows:
    """Where a WRITE's bytes of one page lie in one side's buffer: `count` rows of `nbytes`, the
    first `offset` bytes into the page, `stride` bytes apart; pages are `page_stride` bytes apart."""

    count: int
    nbytes: int
    offset: int
    stride: int
    page_stride: int

    @property
    def whole_pages(self) -> bool:
        """One row covering the page: a run of pages is one contiguous range."""
        return self.count == 1 and self.nbytes == self.page_stride


def page_rows(src: KVLayout, src_heads: range, dst: KVLayout, dst_heads: range) -> tuple[Rows, Rows]:
    """The rows of a WRITE of local heads `src_heads` of pool `src` into `dst_heads` of pool `dst`,
    for each side: whole pages where both move every head they hold, else a row per token."""
    if len(src_heads) != len(dst_heads):
        raise ValueError(f"heads {src_heads} -> {dst_heads}: not as many on both sides")
    whole = len(src_heads) == src.kv_heads == dst.kv_heads
    return _rows(src, src_heads, whole), _rows(dst, dst_heads, whole)


def _rows(layout: KVLayout, heads: range, whole: bool) -> Rows:
    if whole:
        return Rows(1, layout.page_bytes, 0, layout.page_bytes, layout.page_bytes)
    head_bytes = layout.head_page_bytes // layout.page_size  # one head's head_dim elements
    token_bytes = layout.kv_heads * head_bytes
    return Rows(layout.page_size, len(heads) * head_bytes, heads.start * head_bytes, token_bytes, layout.page_bytes)


def check_pages(src_pages: list[int], dst_pages: list[int], src_num_pages: int, dst_num_pages: int) -> None:
    """ValueError unless the page lists can be one transfer: equal non-zero lengths, every page in
    [1, num_pages) of its own pool (page 0 is reserved), no destination page twice."""
    if len(src_pages) != len(dst_pages):
        raise ValueError(f"{len(src_pages)} source pages but {len(dst_pages)} destination pages")
    if not src_pages:
        raise ValueError("no pages to transfer")
    _check_range("source", src_pages, src_num_pages)
    _check_range("destination", dst_pages, dst_num_pages)
    if len(set(dst_pages)) != len(dst_pages):
        raise ValueError(f"a destination page appears twice: {dst_pages}")


def _check_range(side: str, pages: list[int], num_pages: int) -> None:
    bad = [p for p in pages if not (isinstance(p, int) and 0 < p < num_pages)]
    if bad:
        raise ValueError(
            f"{side} pages {bad} are not page ids in [1, {num_pages}) "
            f"(page 0 is reserved; that pool has {num_pages} pages)"
        )


def one_run(src_pages: list[int], dst_pages: list[int]) -> bool:
    """Whether both sides are one run of consecutive pages ([3,4,5] -> [10,11,12]; not [3,4,5] ->
    [10,11,20]). The lists are non-empty and of equal length (check_pages)."""
    n, src, dst = len(src_pages), src_pages[0], dst_pages[0]
    return src_pages == list(range(src, src + n)) and dst_pages == list(range(dst, dst + n))


def coalesce_runs(src_pages: list[int], dst_pages: list[int]) -> list[tuple[int, int, int]]:
    """(src_start, dst_start, num_pages) runs, in order, each contiguous on BOTH sides.

    [3,4,5]->[10,11,12] is one run; [3,4,7]->[10,11,12] is two, as is [3,4,5]->[10,11,20].
    """
    runs: list[tuple[int, int, int]] = []
    for src, dst in zip(src_pages, dst_pages):
        if runs:
            src_start, dst_start, n = runs[-1]
            if src == src_start + n and dst == dst_start + n:
                runs[-1] = (src_start, dst_start, n + 1)
                continue
        runs.append((src, dst, 1))
    return runs


def run_descriptors(
    k_addrs: list[int], v_addrs: list[int], rows: Rows, device_id: int, runs: list[tuple[int, int]]
) -> list[Descriptor]:
    """Descriptors for runs of (start_page, num_pages) of one side, in (layer, K then V, page run)
    order for whole pages, (layer, K then V, page, row) for head slices. Both sides of a transfer
    list theirs in this same order from the same runs, so descriptor i of the source pairs with
    descriptor i of the destination."""
    descriptors: list[Descriptor] = []
    for k_base, v_base in zip(k_addrs, v_addrs, strict=True):
        for base in (k_base, v_base):
            for start, n in runs:
                if rows.whole_pages:
                    descriptors.append((base + start * rows.page_stride, n * rows.page_stride, device_id))
                    continue
                for page in range(start, start + n):
                    first = base + page * rows.page_stride + rows.offset
                    for row in range(rows.count):
                        descriptors.append((first + row * rows.stride, rows.nbytes, device_id))
    return descriptors
