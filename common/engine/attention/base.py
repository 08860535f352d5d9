"""The attention-backend interface: the one seam where torch-native and Triton kernels differ."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from pdserve.common.engine.batch import ForwardBatch
from pdserve.common.engine.kv_pool import PagedKVPool, ReqToTokenPool


class AttentionBackend(ABC):
    """Paged attention over the KV pool.

    Contract of `forward`: first store this forward's new K and V at `batch.out_cache_loc` in
    layer `layer_id` of the pool (unless `kv_stored`: the caller already did, by `rope_and_store`),
    then, for every request, attend its new queries to all of its KV positions [0, seq_len) through
    `req_to_token` — causally (a query at position p sees keys at positions <= p) and, when
    `sliding_window` is set, only keys with p - key_pos < sliding_window.
    q is [T, num_heads, head_dim], k and v [T, kv_heads, head_dim]; query head h reads KV head
    h // (num_heads // kv_heads). Returns [T, num_heads, head_dim] in q's dtype.
    """

    # Whether `rope_and_store` is implemented (one fused kernel); otherwise the model rotates
    # q and k itself and `forward` stores.
    fuses_rope_and_store = False
    # Whether it reads a batch's lengths from the host lists (ForwardBatch.seq_lens), not the device
    # (seq_lens_dev): an overlapped verify step's are then read back (speculative/overlap.py).
    host_lens = True

    def __init__(self, req_to_token_pool: ReqToTokenPool, kv_pool: PagedKVPool):
        self.req_to_token_pool = req_to_token_pool
        self.kv_pool = kv_pool

    def init_forward(self, batch: ForwardBatch) -> None:
        """Called once per forward, before the first layer: build metadata every layer shares."""

    def rope_and_store(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        inv_freq: torch.Tensor,
        layer_id: int,
        batch: ForwardBatch,
    ) -> None:
        """Neox rotary embedding (inv_freq [head_dim / 2] float32, HF roundings) of q and k in place,
        then store k and v as `forward` would; the caller then calls `forward(..., kv_stored=True)`.
        Only where `fuses_rope_and_store`."""
        raise NotImplementedError(f"{type(self).__name__} does not fuse rotary with the KV store")

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        batch: ForwardBatch,
        scale: float,
        sliding_window: int | None = None,
        kv_stored: bool = False,
    ) -> torch.Tensor: ...
