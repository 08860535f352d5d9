"""Tensor-parallel layers (Megatron's split) and the shard each rank loads.

    ColumnParallelLinear   holds some output features (heads, or a slice of the MLP); no communication
    RowParallelLinear      holds the matching input features; its partial sums are all-reduced
    VocabParallelEmbedding holds ceil(vocab / tp) rows; a masked lookup, then an all-reduce
    ParallelLMHead         the same rows as logits; all-gathered, so every rank has the full row

Attention is split by heads: q heads evenly; K/V heads evenly, or — with fewer KV heads than ranks —
one KV head per rank, replicated (ranks r with the same r * kv_heads // tp share one), so the q heads
of a rank always read KV heads it holds. Every rank's KV pool holds its KV heads only.

Each parallel module names its parameters' shards (`tp_shards`: parameter name -> Shard) in the
checkpoint's full coordinates, and the loader reads only those slices. With tp = 1 every shard is
the whole tensor and every collective the identity: the layers are plain nn.Linear / embedding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from pdserve.common.engine.tp import TPGroup


@dataclass(frozen=True)
class Shard:
    """What a rank holds of a checkpoint tensor: the ranges [start, stop) along `dim` (in the
    parameter's layout, nn.Linear's [out, in]) side by side; rows past the tensor's end are zeros
    (vocab padding). `zeros`: none of it (a row-parallel bias off rank 0)."""

    dim: int = 0
    ranges: tuple[tuple[int, int], ...] = ()
    zeros: bool = False


def heads_of_rank(num_heads: int, tp: TPGroup) -> range:
    """The heads rank tp.rank holds: num_heads / tp of them, or, with fewer heads than ranks, the
    one head its group of ranks shares."""
    return kv_heads_of_rank(num_heads, tp.size, tp.rank)


def kv_heads_of_rank(num_heads: int, tp_size: int, rank: int) -> range:
    """heads_of_rank without a group: what any server computes about any other's ranks (the KV
    transfer plan between servers of different TP sizes, common/kv_transfer/tp_plan.py)."""
    if num_heads >= tp_size:
        n = num_heads // tp_size
        return range(rank * n, (rank + 1) * n)
    head = rank * num_heads // tp_size
    return range(head, head + 1)


def head_columns(heads: range, head_dim: int, offset: int = 0) -> tuple[int, int]:
    """The feature range [start, stop) of `heads` in a projection block starting at `offset`."""
    return offset + heads.start * head_dim, offset + heads.stop * head_dim


def even_part(size: int, tp: TPGroup) -> tuple[int, int]:
    """Rank tp.rank's range of `size` features split evenly (the config check made sure it divides)."""
    n = size // tp.size
    return tp.rank * n, (tp.rank + 1) * n


class ColumnParallelLinear(nn.Linear):
    """The output features `ranges` of a Linear (several ranges: a fused q/k/v, each block's share)."""

    def __init__(self, in_features: int, ranges: list[tuple[int, int]], bias: bool):
        super().__init__(in_features, sum(stop - start for start, stop in ranges), bias=bias)
        shard = Shard(0, tuple(ranges))
        self.tp_shards = {"weight": shard, "bias": shard}


class RowParallelLinear(nn.Linear):
    """The input features `in_range` of a Linear; every rank's partial output is summed (all-reduce).

    NOTE the bias is rank 0's alone (zeros elsewhere), so the sum adds it exactly once.
    """

    def __init__(self, in_range: tuple[int, int], out_features: int, bias: bool, tp: TPGroup):
        super().__init__(in_range[1] - in_range[0], out_features, bias=bias)
        self.tp = tp
        self.tp_shards = {"weight": Shard(1, (in_range,)), "bias": Shard(0, ((0, out_features),), zeros=tp.rank != 0)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(super().forward(x))


def vocab_part(vocab_size: int, tp: TPGroup) -> tuple[int, int]:
    """Rank tp.rank's rows of the vocab: ceil(vocab / tp) of them (the last rank's tail is padding)."""
    n = -(-vocab_size // tp.size)
    return tp.rank * n, (tp.rank + 1) * n


class VocabParallelEmbedding(nn.Module):
    """The embedding rows `vocab_part`; a token held elsewhere looks up zeros, and the all-reduce
    adds the one rank's row to zeros (exact)."""

    def __init__(self, vocab_size: int, hidden: int, tp: TPGroup):
        super().__init__()
        self.tp = tp
        self.start, stop = vocab_part(vocab_size, tp)
        self.rows = stop - self.start
        self.weight = nn.Parameter(torch.empty(self.rows, hidden))
        self.tp_shards = {"weight": Shard(0, ((self.start, stop),))}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside[:, None], 0.0)
        return self.tp.all_reduce(out)


class ParallelLMHead(nn.Module):
    """Logits of the rows `vocab_part` (the embedding's when tied), gathered from every rank into
    the full [T, vocab] on each. The weight may carry extra zero rows (GPT-2's fused path pads it
    for cuBLAS); their logits are dropped."""

    def __init__(self, vocab_size: int, hidden: int, tp: TPGroup):
        super().__init__()
        self.tp, self.vocab_size = tp, vocab_size
        start, stop = vocab_part(vocab_size, tp)
        self.rows = stop - start
        self.weight = nn.Parameter(torch.empty(self.rows, hidden))
        self.tp_shards = {"weight": Shard(0, ((start, stop),))}
        self.fp8_logits = None  # hidden -> this rank's logits from a float8 copy (models/fp8.py Fp8Logits)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.weight) if self.fp8_logits is None else self.fp8_logits(hidden)
        if logits.shape[-1] != self.rows:
            logits = logits[:, : self.rows]
        logits = self.tp.all_gather(logits)
        return logits if logits.shape[-1] == self.vocab_size else logits[:, : self.vocab_size]
