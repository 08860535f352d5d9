"""One kernel launch for a whole KV WRITE by device copy (this GPU, or a peer GPU of this host).

Why (docs/benchmarks/one-gpu.md, "The default pair's burst"): `copy_pages` (direct.py) is a gather and a
scatter per buffer — 48 launches for one GPT-2-small prompt, ~1 ms of the prefill scheduler's time
per request under MPS, half of its loop in a 1,024-prompt burst. Here the buffers' base addresses
sit in device tables built once per peer, and one program copies one row (a chunk of a page, or one
token's head slice) of one page of one buffer, so a request's WRITE is one page-index upload and
one launch whatever the model's depth.

    copy_pages_fused(src_table, dst_table, src_pages, dst_pages, ...)   (on the current stream)

The pools are token-major (common/engine/kv_pool.py): a page of a buffer is page_bytes contiguous
bytes, so a WRITE of whole pages copies each page as one range (split in chunks, for the kernel's
parallelism); a WRITE of head slices (servers of different TP sizes) copies a row per token
(pages.Rows says where a side's rows lie).

NOTE: import lazily (direct.py does, on the first copy): Triton reads TRITON_INTERPRET when a
kernel is defined, and the CPU tests set it first.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from pdserve.common.kv_transfer.pages import Rows


# (do_not_specialize: a run's first page is an int that would otherwise compile a kernel of its own
# when it is 1, mid-serving)
@triton.jit(do_not_specialize=["src_pages", "dst_pages"])
def _copy_pages_kernel(
    src_table,  # int64 [buffers]: each source buffer's address
    dst_table,  # int64 [buffers]: the matching destination buffer's address
    src_pages,  # int64 [pages]; with RUN, the run's first page (an int)
    dst_pages,  # int64 [pages]; with RUN, the run's first page (an int)
    num_rows,  # rows copied a page
    src_offset,  # words from a source page's start to its first row
    dst_offset,
    src_row_words,  # words between two rows of a source page
    dst_row_words,
    src_page_words,  # words between two pages of a source buffer
    dst_page_words,
    WORDS: tl.constexpr,  # 32-bit words in one row
    BLOCK: tl.constexpr,
    RUN: tl.constexpr,  # both sides one run of consecutive pages: no page index to read
):
    page = tl.program_id(0)
    buffer_row = tl.program_id(1)
    buffer = buffer_row // num_rows
    row = (buffer_row % num_rows).to(tl.int64)
    src = tl.load(src_table + buffer).to(tl.pointer_type(tl.int32))
    dst = tl.load(dst_table + buffer).to(tl.pointer_type(tl.int32))
    if RUN:
        src_page = (src_pages + page).to(tl.int64)
        dst_page = (dst_pages + page).to(tl.int64)
    else:
        src_page = tl.load(src_pages + page)
        dst_page = tl.load(dst_pages + page)
    src = src + src_offset + row * src_row_words + src_page * src_page_words
    dst = dst + dst_offset + row * dst_row_words + dst_page * dst_page_words
    for start in range(0, WORDS, BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        mask = offsets < WORDS
        tl.store(dst + offsets, tl.load(src + offsets, mask=mask), mask=mask)


def address_table(buffers: list[torch.Tensor]) -> torch.Tensor:
    """The device table of `buffers`' addresses."""
    return torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64, device=buffers[0].device)


def _words(nbytes: int, what: str) -> int:
    if nbytes % 4:
        raise ValueError(f"{what} is {nbytes} bytes, not whole 32-bit words")
    return nbytes // 4


def _chunks(words: int) -> int:
    """Rows to split a contiguous page of `words` into: programs enough to keep the GPU busy, each
    still a few KB."""
    chunks = 1
    while chunks < 64 and words % (2 * chunks) == 0 and words // (2 * chunks) >= 512:
        chunks *= 2
    return chunks


def _launch(
    src_table, dst_table, src_pages, dst_pages, rows: int, src: tuple, dst: tuple, words: int, run: int = 0
) -> None:
    """src and dst: (offset, row stride, page stride) in words. run > 0: the pages are ints, each
    side's first page of a run of `run` pages."""
    _copy_pages_kernel[(run or src_pages.numel(), src_table.numel() * rows)](
        src_table,
        dst_table,
        src_pages,
        dst_pages,
        rows,
        src[0],
        dst[0],
        src[1],
        dst[1],
        src[2],
        dst[2],
        WORDS=words,
        BLOCK=min(1024, triton.next_power_of_2(words)),
        RUN=run > 0,
    )


@functools.lru_cache(maxsize=64)
def _row_plan(src_rows: Rows, dst_rows: Rows) -> tuple[int, tuple, tuple, int]:
    """(rows a page, source side, destination side, words a row) of a copy between two Rows (the
    same few pairs on every WRITE: worked out once each)."""
    words = _words(src_rows.nbytes, "a row")
    sides = [
        tuple(_words(n, "a row's place") for n in (r.offset, r.stride, r.page_stride)) for r in (src_rows, dst_rows)
    ]
    rows = src_rows.count
    if src_rows.whole_pages and dst_rows.whole_pages:  # one range a page: split for parallelism
        rows = _chunks(words)
        words //= rows
        sides = [(0, words, page) for _, _, page in sides]
    return rows, sides[0], sides[1], words


def copy_pages_fused(
    src_table: torch.Tensor,
    dst_table: torch.Tensor,
    src_pages: torch.Tensor | int,
    dst_pages: torch.Tensor | int,
    src_rows: Rows,
    dst_rows: Rows,
    run: int = 0,
) -> None:
    """The rows of src_pages of every buffer b of the source table to the rows of dst_pages of the
    destination's buffer b, in one launch on the current stream. The page tensors are int64 on the
    tables' device; or, where both sides are one run of `run` consecutive pages, the first page of
    each (ints: no page index uploaded, the kernel adds its program's page). The Rows come from
    pages.page_rows."""
    count = run if run else src_pages.numel()
    same_pages = run or dst_pages.numel() == count
    if src_rows.count != dst_rows.count or src_rows.nbytes != dst_rows.nbytes or not same_pages:
        raise ValueError(f"rows {src_rows} -> {dst_rows}, {count} pages")
    if count == 0:
        return
    rows, src_side, dst_side, words = _row_plan(src_rows, dst_rows)
    _launch(src_table, dst_table, src_pages, dst_pages, rows, src_side, dst_side, words, run)


def copy_host_pages(
    host_table: torch.Tensor,
    pool_table: torch.Tensor,
    host_pages: torch.Tensor,
    pool_pages: torch.Tensor,
    page_bytes: int,
    to_host: bool,
) -> None:
    """Pages between a device pool (buffers of contiguous pages of `page_bytes`) and a host tier whose
    page holds every buffer's page contiguously ([buffers, page bytes]: common/engine/host_kv_pool.py),
    in one launch on the current stream: the kernel reads or writes the pinned host pages directly
    (mapped memory: one address for the host and the device), so a load or a store of any number of
    pages is one page-index upload and one launch, not a gather or scatter per buffer.
    `host_table[b]` is the address of buffer b's page in host page 0; `to_host`: pool -> host."""
    if host_pages.numel() != pool_pages.numel() or host_table.numel() != pool_table.numel():
        raise ValueError(f"{host_pages.numel()} host pages, {pool_pages.numel()} pool pages")
    if host_pages.numel() == 0:
        return
    words = _words(page_bytes, "a page")
    rows = _chunks(words)
    row = words // rows
    host = (host_table, host_pages, (0, row, host_table.numel() * words))  # a host page: every buffer's page
    pool = (pool_table, pool_pages, (0, row, words))
    (src_table, src_pages, src), (dst_table, dst_pages, dst) = (pool, host) if to_host else (host, pool)
    _launch(src_table, dst_table, src_pages, dst_pages, rows, src, dst, row)
