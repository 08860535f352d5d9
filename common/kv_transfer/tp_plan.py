"""Which rank of the sending server writes which KV heads into which rank of the receiving one.

Both servers may run tensor parallelism of any size: sender rank i holds the model's KV heads
src[i], receiver rank j holds dst[j] (a slice each, or one head shared by several ranks when TP
exceeds the KV heads). Every head a receiver rank holds must come from exactly one sender rank;
among the sender ranks holding it, receiver rank j takes the (j mod count)-th, so replicated heads
spread the writes over the ranks that share them.

    plan_writes([range(0, 2)], [range(0, 1), range(1, 2)])    P TP1 -> D TP2
        == [Write(0, 0, range(0, 1)), Write(0, 1, range(1, 2))]
    plan_writes([range(0, 1), range(1, 2)], [range(0, 2)])    P TP2 -> D TP1
        == [Write(0, 0, range(0, 1)), Write(1, 0, range(1, 2))]

The receiving server needs no plan: each notification names the heads it moved, and a room is
complete when every receiver rank's heads have landed (decode/arrivals.py).
"""

from __future__ import annotations

from typing import NamedTuple, Sequence


class Write(NamedTuple):
    src_rank: int
    dst_rank: int
    heads: range  # the model's KV heads, held by both ranks


def plan_writes(src: Sequence[range], dst: Sequence[range]) -> list[Write]:
    """The WRITEs, ordered by receiver rank then head; ValueError if a receiver head has no sender."""
    writes: list[Write] = []
    for j, heads in enumerate(dst):
        for head in heads:
            holders = [i for i, held in enumerate(src) if head in held]
            if not holders:
                raise ValueError(f"KV head {head} of receiver rank {j} is held by no sender rank {list(src)}")
            i = holders[j % len(holders)]
            last = writes[-1] if writes else None
            if last is not None and last.src_rank == i and last.dst_rank == j and last.heads.stop == head:
                writes[-1] = Write(i, j, range(last.heads.start, head + 1))
            else:
                writes.append(Write(i, j, range(head, head + 1)))
    return writes
