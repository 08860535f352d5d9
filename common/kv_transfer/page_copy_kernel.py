"""One kernel launch for a whole KV WRITE by device copy (this GPU, or a peer GPU of this host).

Why (docs/benchmarks.md, "The default pair's burst"): `copy_pages` (direct.py) is a gather and a
scatter per buffer — 48 launches for one GPT-2-small prompt, ~1 ms of the prefill scheduler's time
per request under MPS, half of its loop in a 1,024-prompt burst. Here the buffers' base addresses
sit in device tables built once per peer, and one program copies one head's bytes of one page of
one buffer, so a request's WRITE is one page-index upload and one launch whatever the model's depth.

    copy_pages_fused(src_table, dst_table, src_pages, dst_pages, ...)   (on the current stream)

The layout is the pool's head-major one (common/engine/kv_pool.py): a buffer is [heads, pages,
head page bytes], so a head's page is `head_page_bytes` contiguous bytes at
`head * num_pages * head_page_bytes + page * head_page_bytes`.

NOTE: import lazily (direct.py does, on the first copy): Triton reads TRITON_INTERPRET when a
kernel is defined, and the CPU tests set it first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _copy_pages_kernel(
    src_table,  # int64 [buffers]: each source buffer's address
    dst_table,  # int64 [buffers]: the matching destination buffer's address
    src_pages,  # int64 [pages]
    dst_pages,  # int64 [pages]
    num_heads,
    src_head0,  # the first head copied, in the source buffer's heads
    dst_head0,  # where it lands in the destination's
    src_head_words,  # words between two heads of a source buffer (its pages * WORDS)
    dst_head_words,
    src_page_words,  # words between two pages of a source buffer's head (WORDS in a pool)
    dst_page_words,
    WORDS: tl.constexpr,  # 32-bit words in one head's page
    BLOCK: tl.constexpr,
):
    page = tl.program_id(0)
    buffer_head = tl.program_id(1)
    buffer = buffer_head // num_heads
    head = (buffer_head % num_heads).to(tl.int64)
    src = tl.load(src_table + buffer).to(tl.pointer_type(tl.int32))
    dst = tl.load(dst_table + buffer).to(tl.pointer_type(tl.int32))
    src = src + (src_head0 + head) * src_head_words + tl.load(src_pages + page) * src_page_words
    dst = dst + (dst_head0 + head) * dst_head_words + tl.load(dst_pages + page) * dst_page_words
    for start in range(0, WORDS, BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        mask = offsets < WORDS
        tl.store(dst + offsets, tl.load(src + offsets, mask=mask), mask=mask)


def address_table(views: list[torch.Tensor]) -> torch.Tensor:
    """The device table of `views`' addresses (page views, [heads, pages, head page bytes])."""
    return torch.tensor([v.data_ptr() for v in views], dtype=torch.int64, device=views[0].device)


def copy_pages_fused(
    src_table: torch.Tensor,
    dst_table: torch.Tensor,
    src_pages: torch.Tensor,
    dst_pages: torch.Tensor,
    src_heads: range,
    dst_heads: range,
    src_num_pages: int,
    dst_num_pages: int,
    head_page_bytes: int,
) -> None:
    """dst[b][dst_heads, dst_pages] = src[b][src_heads, src_pages] for every buffer b of the tables,
    in one launch on the current stream. The page tensors are int64 on the tables' device."""
    if len(src_heads) != len(dst_heads) or src_pages.numel() != dst_pages.numel():
        raise ValueError(f"heads {src_heads} -> {dst_heads}, pages {src_pages.numel()} -> {dst_pages.numel()}")
    if head_page_bytes % 4:
        raise ValueError(f"a head's page is {head_page_bytes} bytes, not whole 32-bit words")
    if src_pages.numel() == 0:
        return
    words = head_page_bytes // 4
    grid = (src_pages.numel(), src_table.numel() * len(src_heads))
    _copy_pages_kernel[grid](
        src_table,
        dst_table,
        src_pages,
        dst_pages,
        len(src_heads),
        src_heads.start,
        dst_heads.start,
        src_num_pages * words,
        dst_num_pages * words,
        words,
        words,
        WORDS=words,
        BLOCK=min(1024, triton.next_power_of_2(words)),
    )


def copy_host_pages(
    host_table: torch.Tensor,
    pool_table: torch.Tensor,
    host_pages: torch.Tensor,
    pool_pages: torch.Tensor,
    num_heads: int,
    pool_num_pages: int,
    head_page_bytes: int,
    to_host: bool,
) -> None:
    """Pages between a device pool (buffers [heads, pages, head page bytes]) and a host tier whose page
    holds every buffer's heads contiguously ([buffers, heads, head page bytes]: common/engine/
    host_kv_pool.py), in one launch on the current stream: the kernel reads or writes the pinned host
    pages directly (mapped memory: one address for the host and the device), so a load or a store of
    any number of pages is one page-index upload and one launch, not a gather or scatter per buffer.
    `host_table[b]` is the address of buffer b's first head in host page 0; `to_host`: pool -> host."""
    if head_page_bytes % 4:
        raise ValueError(f"a head's page is {head_page_bytes} bytes, not whole 32-bit words")
    if host_pages.numel() != pool_pages.numel() or host_table.numel() != pool_table.numel():
        raise ValueError(f"{host_pages.numel()} host pages, {pool_pages.numel()} pool pages")
    if host_pages.numel() == 0:
        return
    words = head_page_bytes // 4
    host_page_words = host_table.numel() * num_heads * words  # a host page: every buffer's heads
    host = (host_table, host_pages, words, host_page_words)
    pool = (pool_table, pool_pages, pool_num_pages * words, words)
    (src_table, src_pages, src_head, src_page), (dst_table, dst_pages, dst_head, dst_page) = (
        (pool, host) if to_host else (host, pool)
    )
    _copy_pages_kernel[(host_pages.numel(), host_table.numel() * num_heads)](
        src_table,
        dst_table,
        src_pages,
        dst_pages,
        num_heads,
        0,
        0,
        src_head,
        dst_head,
        src_page,
        dst_page,
        WORDS=words,
        BLOCK=min(1024, triton.next_power_of_2(words)),
    )
