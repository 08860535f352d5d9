"""Reference attention in plain torch: runs on CPU and CUDA.

It mirrors Hugging Face's eager attention (scores in the input dtype, softmax in float32) so
greedy output matches transformers token for token. Prefill attends one request at a time; decode
attends the whole batch at once over a padded [batch, max_len] slot table, so a decode step costs
a fixed number of kernels per layer instead of a few per request. It is the correctness reference
for the Triton kernels, not the fast path.
"""

from __future__ import annotations

import torch

from pdserve.common.engine.attention.base import AttentionBackend
from pdserve.common.engine.batch import ForwardBatch
from pdserve.common.engine.overlap import h2d
from pdserve.common.scheduling.batch import ForwardMode


class TorchNativeBackend(AttentionBackend):
    def init_forward(self, batch: ForwardBatch) -> None:
        """Per-forward metadata shared by every layer: the decode batch's slot table and positions."""
        self._decode = None
        if batch.mode is ForwardMode.DECODE:
            max_len = max(batch.seq_lens)
            # Columns past a request's length hold stale slots (or 0): valid indices, masked below.
            slots = self.req_to_token_pool.req_to_token[batch.req_pool_indices, :max_len].long()
            seq_lens = h2d(batch.seq_lens, torch.int64, slots.device)
            k_pos = torch.arange(max_len, device=slots.device)[None, :]
            self._decode = (slots, k_pos, seq_lens[:, None] - 1)  # query position = seq_len - 1

    def forward(self, q, k, v, layer_id, batch: ForwardBatch, scale, sliding_window=None, kv_stored=False):
        if not kv_stored:
            self.kv_pool.set_kv(layer_id, batch.out_cache_loc, k, v)
        if self._decode is not None:
            return self._decode_attention(q, layer_id, scale, sliding_window)
        return self._extend_attention(q, k, v, layer_id, batch, scale, sliding_window)

    def _decode_attention(self, q, layer_id, scale, sliding_window):
        slots, k_pos, q_pos = self._decode
        group = q.shape[1] // self.kv_pool.kv_heads
        keys, values = self.kv_pool.read_kv(layer_id, slots, q.dtype)  # [B, L, KVH, D]
        keys = keys.repeat_interleave(group, dim=2)  # [B, L, H, D]
        values = values.repeat_interleave(group, dim=2)
        scores = torch.einsum("bhd,blhd->bhl", q, keys) * scale  # [B, H, L]
        masked = k_pos > q_pos
        if sliding_window is not None:
            masked = masked | (q_pos - k_pos >= sliding_window)
        scores = scores.masked_fill(masked[:, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.einsum("bhl,blhd->bhd", probs, values)

    def _extend_attention(self, q, k, v, layer_id, batch: ForwardBatch, scale, sliding_window):
        req_to_token = self.req_to_token_pool.req_to_token
        group = q.shape[1] // self.kv_pool.kv_heads
        out = torch.empty_like(q)
        for i in range(batch.batch_size):
            seq_len, ext, start = batch.seq_lens[i], batch.extend_lens[i], batch.extend_starts[i]
            slots = req_to_token[batch.req_rows[i], :seq_len].long()
            keys, values = self.kv_pool.read_kv(layer_id, slots, q.dtype)  # [S, KVH, D]
            if self.kv_pool.quantized:
                # The new tokens attend to each other through their own K and V, as computed; only
                # the prefix is read back through float8 (triton_extend's rule, SGLang's).
                keys[seq_len - ext :] = k[start : start + ext]
                values[seq_len - ext :] = v[start : start + ext]
            keys = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # [H, S, D]
            values = values.repeat_interleave(group, dim=1).transpose(0, 1)
            queries = q[start : start + ext].transpose(0, 1)  # [H, E, D]
            scores = torch.matmul(queries, keys.transpose(1, 2)) * scale  # [H, E, S]
            q_pos = torch.arange(seq_len - ext, seq_len, device=q.device)[:, None]
            k_pos = torch.arange(seq_len, device=q.device)[None, :]
            masked = k_pos > q_pos
            if sliding_window is not None:
                masked = masked | (q_pos - k_pos >= sliding_window)
            scores = scores.masked_fill(masked, float("-inf"))
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
            out[start : start + ext] = torch.matmul(probs, values).transpose(0, 1)
        return out
