"""The draft model's half of a device (speculative decoding, --speculative draft): its weights, its own
paged KV pool and request rows, and an eager greedy forward. The pieces are the model runner's
(common/engine/model_runner.py): load_model, PagedKVPool, ReqToTokenPool and the attention backend; no
CUDA graph, no sampling beyond argmax, no tensor parallelism.

The pool is the draft model's alone: the target's pages, prefix cache and page counts never see it.
Who holds which of its rows and pages is DraftProposer's (draft.py) bookkeeping.
"""

from __future__ import annotations

import itertools

import torch

from pdserve.common.config import EngineConfig
from pdserve.common.engine.attention import create_backend
from pdserve.common.engine.batch import ForwardBatch
from pdserve.common.engine.kv_pool import PagedKVPool, ReqToTokenPool
from pdserve.common.engine.model_runner import DTYPES
from pdserve.common.engine.models.loader import load_model
from pdserve.common.engine.overlap import h2d
from pdserve.common.scheduling.batch import ForwardMode


class DraftRunner:
    def __init__(self, config: EngineConfig, device: torch.device, rows: int, num_pages: int):
        """`rows` requests at once, `num_pages` pages of config.page_size tokens (page 0 reserved)."""
        self.device = device
        self.dtype = DTYPES[config.dtype]
        self.model = load_model(config.draft_model_path, self.dtype, device)
        self.vocab_size = self.model.arch.vocab_size
        num_layers, kv_heads, head_dim = self.model.kv_geometry()
        self.req_to_token_pool = ReqToTokenPool(rows, config.context_length, device)
        self.kv_pool = PagedKVPool(
            num_pages=num_pages,
            page_size=config.page_size,
            num_layers=num_layers,
            kv_heads=kv_heads,
            head_dim=head_dim,
            dtype=self.dtype,  # (the draft's KV in the model's dtype, whatever --kv-cache-dtype says)
            device=device,
            head_start=0,
            model_kv_heads=kv_heads,
        )
        self.attn = create_backend(
            config.attention_backend, self.req_to_token_pool, self.kv_pool, self.model.local_heads(), rows
        )

    @torch.inference_mode()
    def greedy(
        self, input_ids: torch.Tensor, rows: list[int], starts: list[int], lens: list[int], slots: list[int]
    ) -> torch.Tensor:
        """One eager extend forward: request i (ReqToTokenPool row rows[i]) computes positions
        [starts[i], starts[i] + lens[i]), the tokens `input_ids` (device, flat, request after request),
        writing their KV to `slots` (flat too); returns each request's argmax after its last position [B],
        on the device (nothing is read back)."""
        positions = [p for s, n in zip(starts, lens) for p in range(s, s + n)]
        token_rows = [row for row, n in zip(rows, lens) for _ in range(n)]
        flat_starts = [0, *itertools.accumulate(lens)][:-1]
        last_indices = [s + n - 1 for s, n in zip(flat_starts, lens)]
        upload = h2d(positions + slots + token_rows + rows + last_indices, torch.int64, self.device)
        t, b = len(positions), len(rows)
        positions_dev, slots_dev = upload[:t], upload[t : 2 * t]
        rows_dev, last = upload[3 * t : 3 * t + b], upload[3 * t + b :]
        self.req_to_token_pool.write_slots(upload[2 * t : 3 * t], positions_dev, slots_dev)
        batch = ForwardBatch(
            mode=ForwardMode.EXTEND,
            reqs=[],
            input_ids=input_ids,
            positions=positions_dev,
            out_cache_loc=slots_dev,
            req_pool_indices=rows_dev,
            seq_lens=[s + n for s, n in zip(starts, lens)],
            extend_lens=list(lens),
            extend_starts=flat_starts,
            req_rows=list(rows),
            last_indices=last,
            samples=[True] * b,
            has_placeholders=False,
        )
        self.attn.init_forward(batch)
        hidden = self.model(input_ids, positions_dev, batch, self.attn)
        return self.model.compute_logits(hidden[last]).argmax(dim=-1)
