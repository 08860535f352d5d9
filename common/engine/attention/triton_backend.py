"""The fast path on CUDA: paged Triton kernels for the KV store, decode and extend attention.

Per forward, `init_forward` uploads the little metadata the kernels need (one pinned H2D copy);
every layer then runs one store launch and one attention call (decode: one launch, the attention
kernel stores the step's K and V itself); the fused Llama path stores in its rotary launch instead
(`rope_and_store`). Decode and extend can instead be bound to a CUDA graph's
static buffers with `bind_decode` / `bind_extend`, which is what the graph runners do before capture.

The kernel modules are imported here, never by attention/__init__: Triton reads TRITON_INTERPRET
when a kernel is defined, and the CPU tests set it first.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.common.engine.attention.base import AttentionBackend
from pdserve.common.engine.attention.triton_decode import DecodeWorkspace, decode_attention, num_kv_splits_for
from pdserve.common.engine.attention.triton_extend import extend_attention
from pdserve.common.engine.attention.triton_store import rope_store_kv, store_kv
from pdserve.common.engine.batch import ForwardBatch
from pdserve.common.engine.kv_pool import PagedKVPool, ReqToTokenPool
from pdserve.common.engine.overlap import h2d
from pdserve.common.scheduling.batch import ForwardMode

MAX_KV_SPLITS = 16
# Triton's interpreter (CPU: the tests) runs every program in Python, ~16 ms each: two splits keep
# the split-K reduce exercised at an eighth of the programs the GPU's rule would launch.
INTERPRETER_MAX_KV_SPLITS = 2


@dataclass
class DecodeMeta:
    req_pool_indices: torch.Tensor  # [B] int64
    seq_lens: torch.Tensor  # [B] int64, on the device
    num_kv_splits: int


@dataclass
class ExtendMeta:
    req_pool_indices: torch.Tensor  # [B] int64
    seq_lens: torch.Tensor  # [B] int32
    extend_lens: torch.Tensor  # [B] int32
    extend_starts: torch.Tensor  # [B] int32
    max_extend_len: int
    # Whether any request has a cached prefix (a float8 pool's kernel without the prefix's walk is
    # another compile: extend_attention's has_prefix). True wherever the host cannot tell.
    has_prefix: bool = True


class TritonBackend(AttentionBackend):
    host_lens = False
    fuses_rope_and_store = True

    def __init__(self, req_to_token_pool: ReqToTokenPool, kv_pool: PagedKVPool, num_heads: int, max_batch: int):
        super().__init__(req_to_token_pool, kv_pool)
        device = kv_pool.k_buffers[0].device
        self.num_heads = num_heads
        self.max_kv_splits = MAX_KV_SPLITS if device.type == "cuda" else INTERPRETER_MAX_KV_SPLITS
        self.workspace = DecodeWorkspace(max_batch, num_heads, kv_pool.head_dim, MAX_KV_SPLITS, device)
        self.meta: DecodeMeta | ExtendMeta | None = None

    def kv_splits(self, batch_size: int) -> int:
        """Split-K factor of a decode batch (the kernel's tuned rule, about 512 programs).

        Depends on the batch size only, so a captured graph's choice holds for every replay.
        """
        return num_kv_splits_for(batch_size, self.num_heads, self.kv_pool.kv_heads, self.max_kv_splits)

    def init_forward(self, batch: ForwardBatch) -> None:
        bs = batch.batch_size
        if batch.mode is ForwardMode.DECODE:
            self.meta = DecodeMeta(batch.req_pool_indices, batch.seq_lens_dev, self.kv_splits(bs))
            return
        packed = h2d(
            [batch.seq_lens, batch.extend_lens, batch.extend_starts], torch.int32, batch.req_pool_indices.device
        )
        if batch.spec is not None and batch.spec.moves:  # (an overlapped verify step's lengths: the device's)
            packed[0].copy_(batch.seq_lens_dev)
        # (a verify step always extends a prefix, and an overlapped one's host lengths may lag)
        has_prefix = batch.spec is not None or any(s > e for s, e in zip(batch.seq_lens, batch.extend_lens))
        self.meta = ExtendMeta(
            batch.req_pool_indices, packed[0], packed[1], packed[2], max(batch.extend_lens), has_prefix
        )

    def bind_decode(self, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor) -> None:
        """Decode over caller-owned device buffers (a CUDA graph's static inputs)."""
        self.meta = DecodeMeta(req_pool_indices, seq_lens, self.kv_splits(req_pool_indices.numel()))

    def bind_extend(self, req_pool_indices, seq_lens, extend_lens, extend_starts, max_extend_len: int) -> None:
        """Extend over caller-owned device buffers (a prefill graph's static inputs, int32 lengths);
        the attention grid covers `max_extend_len` query tokens per request."""
        self.meta = ExtendMeta(req_pool_indices, seq_lens, extend_lens, extend_starts, max_extend_len)

    def rope_and_store(self, q, k, v, positions, inv_freq, layer_id, batch: ForwardBatch) -> None:
        k_buf, v_buf = self.kv_pool.k_buffers[layer_id], self.kv_pool.v_buffers[layer_id]
        rope_store_kv(q, k, v, positions, inv_freq, k_buf, v_buf, batch.out_cache_loc, *self._scales(layer_id))

    def _scales(self, layer_id: int) -> tuple:
        """The layer's K and V scales for a float8 pool (device views: graphs read their values at
        replay), else nothing."""
        return self.kv_pool.layer_scales(layer_id) if self.kv_pool.quantized else (None, None)

    def forward(self, q, k, v, layer_id, batch: ForwardBatch, scale, sliding_window=None, kv_stored=False):
        k_buf, v_buf = self.kv_pool.k_buffers[layer_id], self.kv_pool.v_buffers[layer_id]
        k_scale, v_scale = self._scales(layer_id)
        out = torch.empty_like(q)
        m = self.meta
        r2t = self.req_to_token_pool.req_to_token
        if isinstance(m, DecodeMeta):
            new = () if kv_stored else (k, v, batch.out_cache_loc)  # decode stores K/V in its own launch
            decode_attention(
                q,
                k_buf,
                v_buf,
                out,
                r2t,
                m.req_pool_indices,
                m.seq_lens,
                scale,
                sliding_window,
                m.num_kv_splits,
                self.workspace,
                *new,
                k_scale=k_scale,
                v_scale=v_scale,
            )
        else:
            if not kv_stored:
                store_kv(k_buf, v_buf, batch.out_cache_loc, k, v, k_scale, v_scale)
            extend_attention(
                q,
                k_buf,
                v_buf,
                out,
                r2t,
                m.req_pool_indices,
                m.seq_lens,
                m.extend_lens,
                m.extend_starts,
                m.max_extend_len,
                scale,
                sliding_window,
                k_scale,
                v_scale,
                k,
                v,
                m.has_prefix,
            )
        return out
