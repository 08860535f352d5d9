"""Continuous batching: which requests run next, their KV bookkeeping, and what their results mean.

Queues (as in SGLang):
    waiting   requests not yet prefilled, in arrival order (fcfs)
    running   requests past prefill, decoded together every decode step
Prefill first: a step runs a prefill batch whenever a waiting request can be admitted, otherwise
a decode batch of everything running.

KV ownership: admission gives a request a ReqToTokenPool row and the pages for its prompt; decode
steps add a page whenever a position crosses into a new one. Admission reserves pages for the
whole sequence (prompt + max_new_tokens), so a running request never finds the pool empty.
Finishing or aborting a request returns its row and pages; `is_idle` checks nothing leaked.
"""

from __future__ import annotations

from collections import deque

import torch

from pdserve.common.batch import ForwardBatch, ForwardMode
from pdserve.common.config import EngineConfig
from pdserve.common.kv_pool import PagedKVPool, ReqToTokenPool, pages_for, slots_for_positions
from pdserve.common.output_processor import append_token, finalize
from pdserve.common.types import Completion, FinishReason, Req, SamplingParams, TokenLogprob


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        req_to_token_pool: ReqToTokenPool,
        kv_pool: PagedKVPool,
        eos_token_ids: tuple[int, ...],
    ):
        self.config = config
        self.req_to_token_pool = req_to_token_pool
        self.kv_pool = kv_pool
        self.page_size = kv_pool.page_size
        self.eos_token_ids = eos_token_ids
        self.device = req_to_token_pool.req_to_token.device
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []

    # ---- intake -------------------------------------------------------------------------------

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError when a request could never run here."""
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        total = len(prompt_ids) + params.max_new_tokens
        if total > self.config.context_length:
            raise ValueError(
                f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({params.max_new_tokens}) "
                f"exceeds the context length {self.config.context_length}"
            )
        if pages_for(total, self.page_size) > self.kv_pool.capacity_pages:
            raise ValueError(f"the sequence needs more KV than the whole pool ({self.kv_pool.capacity_tokens} tokens)")

    def add_request(self, req: Req) -> None:
        self.check_request(req.prompt_ids, req.params)
        self.waiting.append(req)

    def abort(self, rid: str) -> Completion | None:
        """Remove a request wherever it is and free what it holds."""
        for queue in (self.waiting, self.running):
            for req in queue:
                if req.rid == rid:
                    queue.remove(req)
                    req.finish_reason = FinishReason.ABORT
                    return self._release(req)
        return None

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- choosing the next batch ----------------------------------------------------------------

    def get_next_batch_to_run(self) -> ForwardBatch | None:
        batch = self.get_new_batch_prefill()
        if batch is None and self.running:
            batch = self.prepare_decode()
        return batch

    def get_new_batch_prefill(self) -> ForwardBatch | None:
        picked: list[Req] = []
        tokens = 0
        free_pages = self.kv_pool.num_free_pages() - self._outstanding_pages(self.running)
        while self.waiting:
            req = self.waiting[0]
            if len(self.running) + len(picked) >= self.config.max_running_requests:
                break
            extend = req.seq_len - req.kv_len
            if picked and tokens + extend > self.config.max_prefill_tokens:
                break
            if self._final_pages(req) > free_pages:
                break  # fcfs: nobody overtakes the head of the queue
            self.waiting.popleft()
            self._admit(req)
            free_pages -= self._final_pages(req)
            picked.append(req)
            tokens += extend
        return self._build_batch(ForwardMode.EXTEND, picked) if picked else None

    def prepare_decode(self) -> ForwardBatch:
        for req in self.running:
            pos = req.seq_len - 1  # the last sampled token, whose KV this step writes
            if pos // self.page_size >= len(req.pages):
                page = self.kv_pool.alloc_pages(1)
                assert page is not None, "admission reserved this page"
                req.pages += page
        return self._build_batch(ForwardMode.DECODE, list(self.running))

    def _admit(self, req: Req) -> None:
        row = self.req_to_token_pool.alloc()
        assert row is not None, "max_running_requests bounds the rows in use"
        pages = self.kv_pool.alloc_pages(pages_for(req.seq_len, self.page_size))
        assert pages is not None, "checked against free pages"
        req.req_pool_idx, req.pages = row, pages

    def _final_pages(self, req: Req) -> int:
        return pages_for(len(req.prompt_ids) + req.params.max_new_tokens, self.page_size)

    def _outstanding_pages(self, reqs: list[Req]) -> int:
        """Pages promised to admitted requests but not yet taken from the pool."""
        return sum(self._final_pages(r) - len(r.pages) for r in reqs)

    def _build_batch(self, mode: ForwardMode, reqs: list[Req]) -> ForwardBatch:
        input_ids: list[int] = []
        positions: list[int] = []
        out_loc: list[int] = []
        rows, cols = [], []
        seq_lens, extend_lens, extend_starts = [], [], []
        for req in reqs:
            start = req.kv_len if mode is ForwardMode.EXTEND else req.seq_len - 1
            end = req.seq_len
            slots = slots_for_positions(req.pages, start, end, self.page_size)
            extend_starts.append(len(input_ids))
            input_ids += req.fill_ids()[start:end] if mode is ForwardMode.EXTEND else [req.output_ids[-1]]
            positions += range(start, end)
            out_loc += slots
            rows += [req.req_pool_idx] * (end - start)
            cols += range(start, end)
            seq_lens.append(end)
            extend_lens.append(end - start)

        def dev(values: list[int], dtype=torch.int64) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=self.device)

        out_cache_loc = dev(out_loc)
        # The position -> slot entries of the new tokens, written before the forward reads them.
        self.req_to_token_pool.req_to_token[dev(rows), dev(cols)] = out_cache_loc.to(torch.int32)
        req_rows = [r.req_pool_idx for r in reqs]
        return ForwardBatch(
            mode=mode,
            reqs=reqs,
            input_ids=dev(input_ids),
            positions=dev(positions),
            out_cache_loc=out_cache_loc,
            req_pool_indices=dev(req_rows),
            seq_lens=seq_lens,
            extend_lens=extend_lens,
            extend_starts=extend_starts,
            req_rows=req_rows,
        )

    # ---- results --------------------------------------------------------------------------------

    def process_batch_result(
        self, batch: ForwardBatch, next_token_ids: list[int], logprobs: list[TokenLogprob | None]
    ) -> list[Completion]:
        """Append each request's new token, retire the finished ones, move prefilled ones to running."""
        finished: list[Completion] = []
        for req, seq_len, token, lp in zip(batch.reqs, batch.seq_lens, next_token_ids, logprobs):
            req.kv_len = seq_len
            append_token(req, token, lp, self.eos_token_ids, self.config.context_length)
            if req.finished:
                finished.append(self._release(req))
            elif batch.mode is ForwardMode.EXTEND:
                self.running.append(req)
        if finished and batch.mode is ForwardMode.DECODE:
            self.running = [r for r in self.running if not r.finished]
        return finished

    def _release(self, req: Req) -> Completion:
        if req.req_pool_idx is not None:
            self.req_to_token_pool.free(req.req_pool_idx)
            self.kv_pool.free_pages(req.pages)
            req.req_pool_idx, req.pages = None, []
        return finalize(req)

    def is_idle(self) -> bool:
        """Nothing queued and every row and page back in the pools."""
        return (
            not self.has_work()
            and self.req_to_token_pool.available() == self.req_to_token_pool.size
            and self.kv_pool.num_free_pages() == self.kv_pool.capacity_pages
        )
