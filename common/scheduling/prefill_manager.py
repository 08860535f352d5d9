"""The waiting queue and the chunked request: which prompts (or prompt chunks) the next prefill runs.

    waiting       requests not yet (or no longer, after retraction) prefilled
    chunked_req   the one request whose prompt is being prefilled chunk by chunk: in no queue
                  until its last chunk ran
    loading       admitted requests whose cached prefix is still being copied back from the host
                  tier (KVManager.kv_load_done): they hold their pages and run once it is there;
                  the requests behind them are admitted meanwhile
The chunked request always continues first, then the loaded ones. Then waiting requests are admitted in order (fcfs,
or longest cached prefix first) while the token budget, the running-request limit, the rows and
the KV pages allow; nobody overtakes the head of the queue. Admission keeps, for every request
that will decode here, room for its next `reserve_decode_tokens` tokens (KVManager.reserve_pages).
"""

from __future__ import annotations

import time
from collections import deque

from pdserve.common.config import EngineConfig
from pdserve.common.scheduling.kv_manager import KVManager
from pdserve.common.types import Req

Span = tuple[Req, int, int]  # (request, first new position, end)


class PrefillManager:
    def __init__(self, config: EngineConfig, kv: KVManager):
        self.config = config
        self.kv = kv
        self.waiting: deque[Req] = deque()
        self.chunked_req: Req | None = None
        self.loading: list[Req] = []
        chunk = config.chunked_prefill_size
        self.budget = min(config.max_prefill_tokens, chunk) if chunk > 0 else config.max_prefill_tokens
        self.chunking = chunk > 0
        self.stats = {"cache_hit_tokens": 0, "prefill_chunks": 0}

    def has_work(self) -> bool:
        return bool(self.waiting or self.chunked_req or self.loading)

    def waiting_on_loads(self) -> bool:
        """A request waits for a host-tier copy: a step that runs nothing is a wait, not a stall
        (the requests behind it may not fit until it ran)."""
        return bool(self.loading)

    def schedule(self, holders: list[Req]) -> tuple[list[Span], list[Req]]:
        """The next prefill's spans, and the requests whose prompt it completes. `holders` are the
        requests already holding KV here that admission must leave room for (the running batch)."""
        if self.chunked_req is None and not self.waiting and not self.loading:
            return [], []  # the common decode step: nothing to admit
        if (
            self.chunked_req is None
            and not self.loading
            and (len(holders) + 1 > self.config.max_running_requests or self.kv.rows_available() == 0)
        ):
            # Full: the loop below would admit nothing. NOTE: a burst queues far more requests than
            # may run; summing what every running request is owed (reserved_pages) each step only
            # to admit none was 10% of the decode loop's host time on a GPU.
            return [], []
        spans: list[Span] = []
        completed: list[Req] = []
        budget = self.budget
        if self.chunked_req is not None:
            req, self.chunked_req = self.chunked_req, None
            budget -= self._add_span(req, self._chunk_end(req, budget), spans, completed)
        budget = self._resume_loaded(budget, spans, completed)
        available = self.kv.available_pages() - self.kv.reserved_pages(holders + completed + self.loading)
        self._order_waiting()
        while self.waiting and budget > 0 and self.chunked_req is None:
            req = self.waiting[0]
            if req.pending:
                break  # retracted with a result in flight: resume once it is processed (next step)
            if len(holders) + len(completed) + len(self.loading) + 1 > self.config.max_running_requests:
                break
            if self.kv.rows_available() == 0:
                break
            evictable_before = self.kv.available_pages()
            prefix_pages, node = self.kv.match(req)
            # Locking the matched prefix takes its pages out of the evictable ones.
            available -= evictable_before - self.kv.available_pages()
            extend = req.seq_len - len(prefix_pages) * self.kv.page_size
            need = self.kv.reserve_pages(req) - len(prefix_pages)
            too_long = extend > budget and spans and not self.chunking  # a long prompt runs alone
            if too_long or need > available:
                self.kv.unlock(node, req)  # (waits for a copy just started into it: rare)
                break
            self.waiting.popleft()
            self._admit(req, prefix_pages, node)
            available -= need
            if not self.kv.kv_load_done(req):
                self.loading.append(req)  # its prefix is on its way from host memory: the next may run
                continue
            budget -= self._add_span(req, self._chunk_end(req, budget if self.chunking else extend), spans, completed)
        return spans, completed

    def _resume_loaded(self, budget: int, spans: list[Span], completed: list[Req]) -> int:
        """Spans for the loading requests whose prefix has arrived, in admission order, while the
        budget lasts (they were admitted: their pages are reserved). Returns the budget left."""
        while self.loading and budget > 0 and self.chunked_req is None and self.kv.kv_load_done(self.loading[0]):
            req = self.loading[0]
            extend = req.seq_len - req.kv_len
            if extend > budget and spans and not self.chunking:  # a long prompt runs alone
                break
            self.loading.pop(0)
            budget -= self._add_span(req, self._chunk_end(req, budget if self.chunking else extend), spans, completed)
        return budget

    def _admit(self, req: Req, prefix_pages: list[int], node) -> None:
        self.kv.admit(req, prefix_pages, node)
        if not req.output_ids:  # a resumed (retracted) request keeps its first count and time
            req.cached_tokens = req.kv_len
            req.admitted = time.monotonic()
        self.stats["cache_hit_tokens"] += req.kv_len

    def _add_span(self, req: Req, end: int, spans: list[Span], completed: list[Req]) -> int:
        """Prefill the request's positions [kv_len, end) in this batch; returns the tokens used.
        A request whose prompt is not done becomes the chunked request."""
        self.kv.grow(req, end)
        spans.append((req, req.kv_len, end))
        req.prefill_chunks += 1
        req.chunk_starts.append(time.monotonic())
        used = end - req.kv_len
        req.kv_len = end  # launched next: a later forward on the same stream sees these positions
        if end < req.seq_len:
            self.chunked_req = req
        else:
            completed.append(req)
        return used

    def _chunk_end(self, req: Req, budget: int) -> int:
        end = min(req.seq_len, req.kv_len + budget)
        if end < req.seq_len:
            self.stats["prefill_chunks"] += 1
        return end

    def _order_waiting(self) -> None:
        if self.config.schedule_policy == "lpm" and self.kv.tree_cache is not None and len(self.waiting) > 1:
            cached = {id(r): self.kv.cached_prefix_len(r) for r in self.waiting}
            ordered = sorted(self.waiting, key=lambda r: -cached[id(r)])  # stable: fcfs among equals
            self.waiting.clear()
            self.waiting.extend(ordered)

    def remove(self, rid: str) -> Req | None:
        """Take the request out of the waiting queue or the chunked slot (its KV is the caller's)."""
        if self.chunked_req is not None and self.chunked_req.rid == rid:
            req, self.chunked_req = self.chunked_req, None
            return req
        for req in self.loading:
            if req.rid == rid:
                self.loading.remove(req)
                return req
        for req in self.waiting:
            if req.rid == rid:
                self.waiting.remove(req)
                return req
        return None
