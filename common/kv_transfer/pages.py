"""Page lists -> byte-range descriptors: the pure arithmetic under `write_pages`, no transport here.

A descriptor is (address, length, device_id). Pools are head-major (common/engine/kv_pool.py): for
layer l with K base address b, in a pool of P pages, a run of n pages starting at page p of the
pool's local head h is [b + (h*P + p)*hpb, b + (h*P + p + n)*hpb), hpb being one head's page bytes.
"""

from __future__ import annotations

Descriptor = tuple[int, int, int]


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
    k_addrs: list[int],
    v_addrs: list[int],
    head_page_bytes: int,
    num_pages: int,
    device_id: int,
    heads: range,
    runs: list[tuple[int, int]],
) -> list[Descriptor]:
    """One descriptor per (layer, K then V, head, run) in that nesting order, for runs of
    (start_page, num_pages) of the local heads `heads` (0 = the pool's first) of a head-major
    pool of `num_pages` pages. Both sides of a transfer list their descriptors in this same
    order, so descriptor i of the source pairs with descriptor i of the destination."""
    head_bytes = num_pages * head_page_bytes  # one head of one layer: every page, contiguous
    descriptors: list[Descriptor] = []
    for k_base, v_base in zip(k_addrs, v_addrs, strict=True):
        for base in (k_base, v_base):
            for head in heads:
                head_base = base + head * head_bytes
                for start, n in runs:
                    descriptors.append((head_base + start * head_page_bytes, n * head_page_bytes, device_id))
    return descriptors
