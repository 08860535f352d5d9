"""The running batch: requests past prefill, decoded together one token each step.

Each decode step gives every running request a slot for its next token. When the pages run out,
requests are retracted until the rest fit: the one with the least output (then the longest
prompt, then the latest admitted) goes back to the waiting queue with its output so far, its
written KV cached, to be prefilled again later; it loses the least work.
"""

from __future__ import annotations

from collections.abc import Callable

from pdserve.common.config import EngineConfig
from pdserve.common.scheduling.kv_manager import KVManager
from pdserve.common.types import Req


class DecodeManager:
    def __init__(self, config: EngineConfig, kv: KVManager, retract: Callable[[Req], None]):
        self.config = config
        self.kv = kv
        self.retract = retract  # takes a victim out of running KV: cache it, requeue it
        self.running: list[Req] = []
        self.stats = {"retractions": 0}

    def schedule(self) -> tuple[list[Req], list[int]]:
        """The requests of the next decode step and their lengths after it (each computes position
        length - 1), retracting requests if KV runs out. The hot path of every decode step: each
        request's length is computed once."""
        # NOTE: no chunked request exists here (prefill runs it to its end first), so every page
        # not held by a running request is free or evictable, and one request alone always fits.
        while True:
            reqs, ends, growing = self._active()
            if not reqs or len(growing) <= self.kv.available_pages():
                break
            self._retract_one(reqs)
        for req, page in zip(growing, self.kv.alloc_pages(len(growing))):
            req.pages.append(page)
        for req, end in zip(reqs, ends):
            req.kv_len = end
        return reqs, ends

    def _active(self) -> tuple[list[Req], list[int], list[Req]]:
        """Running requests worth another step (not already at max_new_tokens or the context with
        the token in flight), their lengths, and those whose next position needs a new page."""
        page, context = self.kv.page_size, self.config.context_length
        reqs, ends, growing = [], [], []
        for req in self.running:
            n = req.seq_len
            if n >= context or len(req.output_ids) + req.pending >= req.params.max_new_tokens:
                continue
            reqs.append(req)
            ends.append(n)
            if (n - 1 + req.spec_ahead) // page >= len(req.pages):  # (a verify step in flight may move it)
                growing.append(req)
        return reqs, ends, growing

    def _retract_one(self, candidates: list[Req]) -> None:
        victim = min(reversed(candidates), key=lambda r: (r.num_sampled, -len(r.prompt_ids)))
        self.running.remove(victim)
        self.retract(victim)
        self.stats["retractions"] += 1

    def remove(self, rid: str) -> Req | None:
        for req in self.running:
            if req.rid == rid:
                self.running.remove(req)
                return req
        return None

    def drop_finished(self) -> None:
        self.running = [r for r in self.running if not r.finished]
