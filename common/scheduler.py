"""Continuous batching: which requests run next, their KV bookkeeping, and what their results mean.

Queues (as in SGLang):
    waiting       requests not yet (or no longer, after retraction) prefilled
    chunked_req   the one request whose prompt is being prefilled chunk by chunk: in neither queue
                  until its last chunk ran
    running       requests past prefill, decoded together every decode step
Prefill first: a step runs a prefill batch whenever something can be admitted (the chunked
request always continues first), otherwise a decode batch of everything running.

KV ownership. A request owns a ReqToTokenPool row and `req.pages`; the first `req.prefix_pages`
of those belong to the radix cache (matched at admission, locked through `req.last_node`), the
rest are its own. Finishing inserts its written KV into the cache (which takes the pages it did
not have) and frees the rest; aborting frees without caching; retraction caches what was written
and sends the request back to `waiting` with its output so far, to be prefilled again later.

Admission counts cached-but-unlocked pages as free (they are evicted on demand) and keeps, for
every running request, room for its next `num_reserved_decode_tokens` tokens. When a decode step
still finds no page for some request, the scheduler retracts requests until it does.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np
import torch

from pdserve.common.batch import ForwardBatch, ForwardMode
from pdserve.common.config import EngineConfig
from pdserve.common.kv_pool import PagedKVPool, ReqToTokenPool, pages_for, slots_for_positions
from pdserve.common.output_processor import append_token, finalize, finalize_all
from pdserve.common.overlap import h2d, h2d_array
from pdserve.common.radix_cache import RadixCache
from pdserve.common.types import Completion, FinishReason, Req, SamplingParams, TokenLogprob


class Scheduler:
    # A prefill-only role (the prefill server) neither decodes nor reserves KV for decoding.
    decodes = True

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
        self.tree_cache = None if config.disable_radix_cache else RadixCache(kv_pool)
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.chunked_req: Req | None = None
        chunk = config.chunked_prefill_size
        self.prefill_budget = min(config.max_prefill_tokens, chunk) if chunk > 0 else config.max_prefill_tokens
        self.chunking = chunk > 0
        self.stats = {"cache_hit_tokens": 0, "prefill_chunks": 0, "retractions": 0}

    # ---- intake -------------------------------------------------------------------------------

    def check_request(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
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
        """Remove a request wherever it is and free what it holds (nothing is cached)."""
        queues = [self.waiting, self.running] + ([[self.chunked_req]] if self.chunked_req else [])
        for queue in queues:
            for req in queue:
                if req.rid == rid:
                    if req is self.chunked_req:
                        self.chunked_req = None
                    else:
                        queue.remove(req)
                    req.finish_reason = FinishReason.ABORT
                    req.discard = req.pending  # results still in flight are dropped on arrival
                    self._free_kv(req)
                    return finalize(req)
        return None

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked_req)

    # ---- choosing the next batch ----------------------------------------------------------------

    def get_next_batch_to_run(self) -> ForwardBatch | None:
        batch = self.get_new_batch_prefill()
        if batch is None and self.running:
            batch = self.prepare_decode()
        return batch

    def get_new_batch_prefill(self) -> ForwardBatch | None:
        if self.chunked_req is None and not self.waiting:
            return None  # the common decode step: nothing to admit
        spans: list[tuple[Req, int, int]] = []  # (req, first new position, end)
        budget = self.prefill_budget
        if self.chunked_req is not None:
            req, self.chunked_req = self.chunked_req, None
            budget -= self._add_span(req, self._chunk_end(req, budget), spans)
        available = self._available_pages() - self._reserved_pages(self.running)
        self._order_waiting()
        chunking_one = self.chunked_req is not None
        while self.waiting and budget > 0 and not chunking_one:
            req = self.waiting[0]
            if req.pending:
                break  # retracted with a result in flight: resume once it is processed (next step)
            if len(self.running) + 1 > self.config.max_running_requests:
                break
            if self.req_to_token_pool.available() == 0:
                break
            evictable_before = self._available_pages()
            prefix_pages, node = self._match(req)
            # Locking the matched prefix takes its pages out of the evictable ones.
            available -= evictable_before - self._available_pages()
            extend = req.seq_len - len(prefix_pages) * self.page_size
            need = self._decode_reserve_pages(req, req.seq_len) - len(prefix_pages)
            too_long = extend > budget and spans and not self.chunking  # a long prompt runs alone
            if too_long or need > available:
                self._unlock(node)
                break  # nobody overtakes the head of the queue
            self.waiting.popleft()
            self._admit(req, prefix_pages, node)
            budget -= self._add_span(req, self._chunk_end(req, budget if self.chunking else extend), spans)
            available -= need
            chunking_one = self.chunked_req is not None
        return self._build_batch(ForwardMode.EXTEND, spans) if spans else None

    def _add_span(self, req: Req, end: int, spans: list) -> int:
        """Prefill the request's positions [kv_len, end) in this batch; returns the tokens used.

        A request whose prompt is not done becomes the chunked request; one that is joins the
        running batch now, so the next decode step feeds it a placeholder for this token.
        """
        self._grow_pages(req, end)
        spans.append((req, req.kv_len, end))
        if end < req.seq_len:
            self.chunked_req = req
        elif self.decodes:
            self.running.append(req)
        return end - req.kv_len

    def prepare_decode(self) -> ForwardBatch | None:
        """Give every running request a slot for its last token, retracting requests if KV runs out."""
        # NOTE: no chunked request exists here (prefill first runs it to its end), so every page not
        # held by a running request is free or evictable, and one request alone always fits.
        while True:
            active = [r for r in self.running if not self._surely_done(r)]
            growing = [r for r in active if self._needs_page(r)]
            if not active or len(growing) <= self._available_pages():
                break
            self._retract_one(active)
        for req, page in zip(growing, self._alloc_pages(len(growing))):
            req.pages.append(page)
        spans = [(req, req.seq_len - 1, req.seq_len) for req in active]
        return self._build_batch(ForwardMode.DECODE, spans) if spans else None

    def _surely_done(self, req: Req) -> bool:
        """Its pending token already reaches max_new_tokens or the context: another step is waste."""
        return req.num_sampled >= req.params.max_new_tokens or req.seq_len >= self.config.context_length

    # ---- KV bookkeeping -------------------------------------------------------------------------

    def _match(self, req: Req):
        """Cached pages for the request's tokens (locked), leaving at least one token to compute."""
        if self.tree_cache is None:
            return [], None
        pages, node = self.tree_cache.match_prefix(req.fill_ids()[: req.seq_len - 1])
        self.tree_cache.inc_lock_ref(node)
        return pages, node

    def _unlock(self, node) -> None:
        if node is not None:
            self.tree_cache.dec_lock_ref(node)

    def _admit(self, req: Req, prefix_pages: list[int], node) -> None:
        row = self.req_to_token_pool.alloc()
        req.req_pool_idx, req.pages, req.prefix_pages, req.last_node = row, list(prefix_pages), len(prefix_pages), node
        req.kv_len = len(prefix_pages) * self.page_size
        if not req.output_ids:  # a resumed (retracted) request keeps its first count
            req.cached_tokens = req.kv_len
        self.stats["cache_hit_tokens"] += req.kv_len
        if req.kv_len:
            slots = slots_for_positions(req.pages, 0, req.kv_len, self.page_size)
            self.req_to_token_pool.write(row, 0, h2d(slots, torch.int32, self.device))

    def _chunk_end(self, req: Req, budget: int) -> int:
        end = min(req.seq_len, req.kv_len + budget)
        if end < req.seq_len:
            self.stats["prefill_chunks"] += 1
        return end

    def _grow_pages(self, req: Req, end: int) -> None:
        """Make sure req.pages cover positions [0, end)."""
        missing = pages_for(end, self.page_size) - len(req.pages)
        if missing > 0:
            req.pages += self._alloc_pages(missing)

    def _needs_page(self, req: Req) -> bool:
        return (req.seq_len - 1) // self.page_size >= len(req.pages)

    def _alloc_pages(self, n: int) -> list[int]:
        free = self.kv_pool.num_free_pages()
        if free < n and self.tree_cache is not None:
            self.tree_cache.evict(n - free)
        pages = self.kv_pool.alloc_pages(n)
        assert pages is not None, "admission and retraction keep enough pages available"
        return pages

    def _available_pages(self) -> int:
        evictable = self.tree_cache.evictable_pages if self.tree_cache is not None else 0
        return self.kv_pool.num_free_pages() + evictable

    def _decode_reserve_pages(self, req: Req, seq_len: int) -> int:
        """Pages the request should hold to run its next num_reserved_decode_tokens tokens."""
        if not self.decodes:
            return pages_for(seq_len, self.page_size)
        ahead = min(req.params.max_new_tokens - req.num_sampled, self.config.num_reserved_decode_tokens)
        return pages_for(seq_len + ahead, self.page_size)

    def _reserved_pages(self, reqs: list[Req]) -> int:
        return sum(max(0, self._decode_reserve_pages(r, r.seq_len) - len(r.pages)) for r in reqs)

    def _order_waiting(self) -> None:
        if self.config.schedule_policy == "lpm" and self.tree_cache is not None and len(self.waiting) > 1:
            cached = {id(r): self.tree_cache.cached_prefix_len(r.fill_ids()[: r.seq_len - 1]) for r in self.waiting}
            self.waiting = deque(sorted(self.waiting, key=lambda r: -cached[id(r)]))  # stable: fcfs among equals

    def _retract_one(self, candidates: list[Req]) -> None:
        """Send the candidate with the least output (then the longest prompt, then the latest
        admitted) back to waiting: it loses the least work."""
        victim = min(reversed(candidates), key=lambda r: (r.num_sampled, -len(r.prompt_ids)))
        self.running.remove(victim)
        self._cache_and_release(victim)
        # A token still in flight is dropped when it arrives; the resumed prefill samples it again
        # at the same step with the same seed.
        victim.discard, victim.kv_len = victim.pending, 0
        self.waiting.appendleft(victim)
        self.stats["retractions"] += 1

    def _cache_and_release(self, req: Req) -> None:
        """Hand the request's written KV to the cache (whole pages), free the rest, drop its row."""
        if self.tree_cache is None:
            self._free_kv(req)
            return
        full = req.kv_len // self.page_size
        already = self.tree_cache.insert(req.fill_ids()[: full * self.page_size], req.pages[:full])
        self.kv_pool.free_pages(req.pages[req.prefix_pages : already] + req.pages[full:])
        self._unlock(req.last_node)
        self._drop_row(req)

    def _free_kv(self, req: Req) -> None:
        """Free the request's own pages and unlock its cached prefix; nothing is cached."""
        if req.req_pool_idx is None:
            return
        self.kv_pool.free_pages(req.pages[req.prefix_pages :])
        self._unlock(req.last_node)
        self._drop_row(req)

    def _drop_row(self, req: Req) -> None:
        self.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx, req.pages, req.prefix_pages, req.last_node = None, [], 0, None

    def _build_batch(self, mode: ForwardMode, spans: list[tuple[Req, int, int]]) -> ForwardBatch:
        if mode is ForwardMode.DECODE:
            return self._build_decode_batch([req for req, _, _ in spans])
        # Per-token fields are built with numpy over the whole batch: a prefill batch can hold
        # tens of thousands of tokens, too many for per-token Python.
        page = self.page_size
        ids: list[int] = []
        page_table: list[int] = []  # every request's pages, back to back
        page_base, seq_lens, extend_lens, extend_starts, samples = [], [], [], [], []
        num_tokens = 0
        for req, start, end in spans:
            extend_starts.append(num_tokens)
            num_tokens += end - start
            known = req.prompt_ids if end <= len(req.prompt_ids) else req.fill_ids()
            ids += known[start:end]
            page_base.append(len(page_table))
            page_table += req.pages
            seq_lens.append(end)
            extend_lens.append(end - start)
            samples.append(end == req.seq_len)
            req.kv_len = end  # launched: a later forward on the same stream sees these positions
        lens = np.asarray(extend_lens, dtype=np.int64)
        first = np.asarray([start for _, start, _ in spans], dtype=np.int64)
        positions = np.arange(num_tokens, dtype=np.int64) + np.repeat(first - np.asarray(extend_starts, dtype=np.int64), lens)
        page_index = np.repeat(np.asarray(page_base, dtype=np.int64), lens) + positions // page
        out_loc = np.asarray(page_table, dtype=np.int64)[page_index] * page + positions % page
        reqs = [req for req, _, _ in spans]
        req_rows = [r.req_pool_idx for r in reqs]
        last = [s + n - 1 for s, n in zip(extend_starts, extend_lens)]
        # One upload for everything; the fields are views of it.
        t, b = num_tokens, len(reqs)
        per_req = np.asarray(req_rows + last + seq_lens, dtype=np.int64)
        rows = np.repeat(np.asarray(req_rows, dtype=np.int64), lens)
        input_ids = np.asarray(ids, dtype=np.int64)
        packed = h2d_array(np.concatenate([input_ids, positions, out_loc, rows, per_req]), self.device)
        ids_d, pos_d, loc_d, rows_d = packed[:t], packed[t : 2 * t], packed[2 * t : 3 * t], packed[3 * t : 4 * t]
        self._write_slots(rows_d, pos_d, loc_d)
        return ForwardBatch(
            mode=ForwardMode.EXTEND,
            reqs=reqs,
            input_ids=ids_d,
            positions=pos_d,
            out_cache_loc=loc_d,
            req_pool_indices=packed[4 * t : 4 * t + b],
            seq_lens=seq_lens,
            extend_lens=extend_lens,
            extend_starts=extend_starts,
            req_rows=req_rows,
            last_indices=packed[4 * t + b : 4 * t + 2 * b],
            samples=samples,
            has_placeholders=False,  # a prefill feeds only tokens the host knows
            seq_lens_dev=packed[4 * t + 2 * b :],
            packed=packed[: 3 * t].view(3, t),
        )

    def _build_decode_batch(self, reqs: list[Req]) -> ForwardBatch:
        """One new token per request, at position seq_len - 1; the hot path of every decode step."""
        page = self.page_size
        input_ids, positions, out_loc, req_rows, seq_lens = [], [], [], [], []
        for req in reqs:
            seq_len = req.seq_len
            pos = seq_len - 1
            # The last token: a FutureMap placeholder while its value is still in flight.
            input_ids.append(-req.future_idx if req.pending else (req.output_ids or req.prompt_ids)[-1])
            positions.append(pos)
            out_loc.append(req.pages[pos // page] * page + pos % page)
            req_rows.append(req.req_pool_idx)
            seq_lens.append(seq_len)
            req.kv_len = seq_len
        b = len(reqs)
        # Rows of one [6, B] upload: the CUDA-graph runner copies rows 0-4 in one strided copy.
        packed = h2d([input_ids, positions, out_loc, req_rows, seq_lens, list(range(b))], torch.int64, self.device)
        self._write_slots(packed[3], packed[1], packed[2])
        return ForwardBatch(
            mode=ForwardMode.DECODE,
            reqs=reqs,
            input_ids=packed[0],
            positions=packed[1],
            out_cache_loc=packed[2],
            req_pool_indices=packed[3],
            seq_lens=seq_lens,
            extend_lens=[1] * b,
            extend_starts=list(range(b)),
            req_rows=req_rows,
            last_indices=packed[5],
            samples=[True] * b,
            has_placeholders=any(t < 0 for t in input_ids),
            seq_lens_dev=packed[4],
            packed=packed,
        )

    def _write_slots(self, rows: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """req_to_token[row, position] = slot for the new tokens: queued on the schedule stream,
        before the forward that reads them."""
        self.req_to_token_pool.req_to_token[rows, positions] = slots.to(torch.int32)

    def on_launched(self, batch: ForwardBatch, future_slots: list[int]) -> None:
        """The batch's forward is queued: each sampling request now has a token in flight."""
        for req, sampling, slot in zip(batch.reqs, batch.samples, future_slots):
            if sampling:
                req.pending += 1
                req.future_idx = slot
                if req.finished:  # finished (or aborted) after this batch was built
                    req.discard += 1

    # ---- results --------------------------------------------------------------------------------

    def process_batch_result(
        self, batch: ForwardBatch, next_token_ids: list[int], logprobs: list[TokenLogprob | None]
    ) -> list[Completion]:
        """Append each request's new token, retire the finished ones.

        Mid-prompt chunks sample nothing real; results for requests that finished, were aborted or
        were retracted after the batch was launched are dropped (req.discard). A finished request
        gives its KV back at once: anything still in flight that reads it is ordered before any
        later reuse by the forward stream and the WAR barrier.
        """
        done: list[Req] = []
        for req, sampling, token, lp in zip(batch.reqs, batch.samples, next_token_ids, logprobs):
            if not sampling:
                continue
            req.pending -= 1
            if req.discard:
                req.discard -= 1
                continue
            append_token(req, token, lp, self.eos_token_ids, self.config.context_length)
            if req.finished:
                self._cache_and_release(req)
                req.discard = req.pending  # a step launched after this one is dropped
                done.append(req)
        if not done:
            return []
        self.running = [r for r in self.running if not r.finished]
        return finalize_all(done)

    def kv_used_tokens(self) -> int:
        """KV tokens held by requests: neither free nor cached-and-evictable."""
        evictable = self.tree_cache.evictable_pages if self.tree_cache is not None else 0
        return self.kv_pool.used_tokens() - evictable * self.page_size

    def is_idle(self) -> bool:
        """Nothing queued, every row back, and every page either free or cached and unlocked."""
        cached = self.tree_cache.evictable_pages if self.tree_cache is not None else 0
        locked = self.tree_cache.protected_pages if self.tree_cache is not None else 0
        return (
            not self.has_work()
            and self.req_to_token_pool.available() == self.req_to_token_pool.size
            and locked == 0
            and self.kv_pool.num_free_pages() + cached == self.kv_pool.capacity_pages
        )
