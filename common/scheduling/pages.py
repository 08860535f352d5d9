"""Page arithmetic of a paged KV cache: pages a length needs, the slots of a request's positions."""

from __future__ import annotations


def pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


def slots_for_positions(pages: list[int], start: int, end: int, page_size: int) -> list[int]:
    """KV slots of positions [start, end) of a request whose i-th page is pages[i]."""
    return [pages[p // page_size] * page_size + p % page_size for p in range(start, end)]
