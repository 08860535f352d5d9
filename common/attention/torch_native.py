"""Reference attention in plain torch: runs on CPU and CUDA, one request at a time.

It mirrors Hugging Face's eager attention (scores in the input dtype, softmax in float32) so
greedy output matches transformers token for token. It is the correctness reference for the
Triton kernels, not the fast path.
"""

from __future__ import annotations

import torch

from pdserve.common.attention.base import AttentionBackend
from pdserve.common.batch import ForwardBatch


class TorchNativeBackend(AttentionBackend):
    def forward(self, q, k, v, layer_id, batch: ForwardBatch, scale, sliding_window=None):
        self.kv_pool.set_kv(layer_id, batch.out_cache_loc, k, v)
        k_buf = self.kv_pool.k_buffers[layer_id]
        v_buf = self.kv_pool.v_buffers[layer_id]
        req_to_token = self.req_to_token_pool.req_to_token
        num_heads, kv_heads = q.shape[1], k_buf.shape[1]
        group = num_heads // kv_heads
        out = torch.empty_like(q)
        for i in range(batch.batch_size):
            seq_len, ext, start = batch.seq_lens[i], batch.extend_lens[i], batch.extend_starts[i]
            slots = req_to_token[batch.req_rows[i], :seq_len].long()
            keys = k_buf[slots].to(q.dtype).repeat_interleave(group, dim=1).transpose(0, 1)  # [H, S, D]
            values = v_buf[slots].to(q.dtype).repeat_interleave(group, dim=1).transpose(0, 1)
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
