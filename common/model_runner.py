"""Owns the device state: the model, the KV pools and the attention backend; runs one forward.

The scheduler decides what runs and does the KV bookkeeping; the runner turns a ForwardBatch into
next-token logits and samples them. It never looks at request state beyond what sampling needs.
"""

from __future__ import annotations

import torch

from pdserve.common.attention import create_backend
from pdserve.common.batch import ForwardBatch
from pdserve.common.config import EngineConfig
from pdserve.common.kv_pool import PagedKVPool, ReqToTokenPool, pages_for
from pdserve.common.models.loader import load_model
from pdserve.common.sampling import SampleOutput, SamplingBatchInfo, sample

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class ModelRunner:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = DTYPES[config.dtype]
        self.model = load_model(config.model_path, self.dtype, self.device)
        self.vocab_size = self.model.arch.vocab_size
        num_layers, kv_heads, head_dim = self.model.kv_geometry()
        bytes_per_token = 2 * num_layers * kv_heads * head_dim * self.dtype.itemsize
        self.req_to_token_pool = ReqToTokenPool(config.max_running_requests, config.context_length, self.device)
        self.kv_pool = PagedKVPool(
            num_pages=1 + self._kv_pages(bytes_per_token),
            page_size=config.page_size,
            num_layers=num_layers,
            kv_heads=kv_heads,
            head_dim=head_dim,
            dtype=self.dtype,
            device=self.device,
        )
        self.attn = create_backend("torch_native", self.req_to_token_pool, self.kv_pool)

    def _kv_pages(self, bytes_per_token: int) -> int:
        c = self.config
        tokens = c.max_total_tokens
        if tokens == 0:
            by_memory = int(c.kv_cache_memory_gb * 2**30) // bytes_per_token
            # More than every running request at full context can never be used.
            tokens = min(by_memory, c.max_running_requests * c.context_length)
        pages = pages_for(tokens, c.page_size)
        if pages < pages_for(c.context_length, c.page_size):
            raise ValueError(
                f"KV cache of {pages * c.page_size} tokens cannot hold one sequence of the context length "
                f"{c.context_length}; raise --max-total-tokens or lower --context-length"
            )
        return pages

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Next-token logits, float32 [batch_size, vocab]."""
        hidden = self.model(batch.input_ids, batch.positions, batch, self.attn)
        last = torch.tensor(batch.last_token_indices(), dtype=torch.int64, device=self.device)
        return self.model.compute_logits(hidden[last])

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, info: SamplingBatchInfo) -> SampleOutput:
        return sample(logits, info)
