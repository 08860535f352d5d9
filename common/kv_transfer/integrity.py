"""A checksum of the KV pages one WRITE moves, computed by the sender over its source pages and by the
receiver over the pages that landed, so that pages which are not what the prefill computed are never
decoded (`--kv-integrity-check` on the decode server; the prefill server follows what each decode
pool publishes: PoolMetadata.verify_kv).

The sum covers exactly the bytes the WRITE moves: for each buffer b (K of every layer, then V), each
page j of the WRITE (in the WRITE's order) and each 32-bit word k of that page's moved heads (token by
token, the heads' slice of each token: the same sequence on both sides whatever their TP sizes):

    sum = Σ word[b, j, k] · (2 · ((b · n + j) · K + k) + 1)   mod 2^32      (n pages, K words a page)

The weights are odd and differ by position, so a page written to the wrong place, a stale page and a
changed word all change the sum (unlike a plain sum of the words).

NOTE (cost): this is torch's reference, a gather, a multiply and a sum per buffer and one read of the
result to the host, on the scheduler thread; on a GPU that read waits for everything queued before it,
so each request's sum stalls the overlap loop on both servers: measured on an H200, the GPT-2 burst
(1,024 x 256 -> 256, a prefill and a decode server on one GPU) served 0.40x with the check on
(docs/benchmarks/transfers.md, "The KV integrity check's cost"). Hence opt-in. To make it cheap: sum on
a side stream into a pinned slot and send the notification (admit the arrival) once its event is done.
"""

from __future__ import annotations

import torch

MASK = 0xFFFFFFFF


def kv_checksum(views: list[torch.Tensor], pages: list[int], heads: range) -> int:
    """The checksum of `heads` (local indices) of `pages` in every buffer; `views` are the pool's page
    views (direct.page_view: [pages, page_size, kv_heads, head bytes] as bytes)."""
    if not pages:
        return 0
    device = views[0].device
    index = torch.tensor(pages, dtype=torch.int64, device=device)
    n = len(pages)
    total = torch.zeros((), dtype=torch.int64, device=device)
    positions = None
    for b, view in enumerate(views):
        moved = view.index_select(0, index)[:, :, heads.start : heads.stop].contiguous()
        words = moved.view(torch.int32).view(n, -1).to(torch.int64)
        if positions is None:
            positions = torch.arange(words.numel(), dtype=torch.int64, device=device).view(n, -1)
        # (int64 products and sums wrap past 2^63; only the low 32 bits are kept, and those wrap alike)
        total += (words * (2 * (positions + b * words.numel()) + 1)).sum()
    return int(total.item()) & MASK
