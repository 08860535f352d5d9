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

Span = tuple[Req, int, int]


class DecodeManager:
    def __init__(self, config: EngineConfig, kv: KVManager, retract: Callable[[Req], None]):
        self.config = config
        self.kv = kv
        self.retract = retract  # takes a victim out of running KV: cache it, requeue it
        self.running: list[Req] = []
        self.stats = {"retractions": 0}

    def schedule(self) -> list[Span]:
        """A slot for every running request's last token, retracting requests if KV runs out."""
        # NOTE: no chunked request exists here (prefill runs it to its end first), so every page
        # not held by a running request is free or evictable, and one request alone always fits.
        while True:
            active = [r for r in self.running if not self._surely_done(r)]
            growing = [r for r in active if self.kv.needs_page(r)]
            if not active or len(growing) <= self.kv.available_pages():
                break
            self._retract_one(active)
        for req, page in zip(growing, self.kv.alloc_pages(len(growing))):
            req.pages.append(page)
        spans = []
        for req in active:
            spans.append((req, req.seq_len - 1, req.seq_len))
            req.kv_len = req.seq_len
        return spans

    def _surely_done(self, req: Req) -> bool:
        """Its pending token already reaches max_new_tokens or the context: another step is waste."""
        return req.num_sampled >= req.params.max_new_tokens or req.seq_len >= self.config.context_length

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
