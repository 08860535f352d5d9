"""The proposer interface of speculative decoding: what Speculation (speculation.py) asks of whatever
drafts tokens. Two are built, common/engine/speculative/ngram.py (a copy of the request's own text) and
draft.py (a small model with its own KV pool); EAGLE would be a third.

A proposer may hold state per request (an index, draft KV): Speculation tells it when a request's tokens
are settled after a verify step (`rollback`) and when the request leaves the running batch (`release`:
finished, aborted or retracted), and `is_idle` says that nothing is held any more.
"""

from __future__ import annotations

from pdserve.common.types import Req


class Proposer:
    """Drafts continuing running requests. Subclasses define `propose_for`; the rest has defaults for a
    proposer that holds nothing it must give back."""

    # Whether `propose_after` is defined: a verify step may then be scheduled while the request's previous
    # step still runs (the overlapped verify step, speculation.py); otherwise that step is processed first.
    hypothesizes = False

    def propose_for(self, req: Req, limit: int) -> list[int]:
        """At most `limit` (>= 1) tokens continuing `req`'s prompt and output (no token of it pending)."""
        raise NotImplementedError

    def propose_batch(
        self,
        reqs: list[Req],
        limits: list[int],
        extras: list[list[int] | None] | None = None,
        guesses: list[bool] | None = None,
    ) -> list[list[int]]:
        """Drafts for a decode step's requests at once (a model drafts them in one batch); `limits[i]`
        <= 0: none for request i. `extras[i]` not None: request i's previous step is still in flight, and
        its drafts continue the request's known tokens and then `extras[i]` (`propose_after`).
        `guesses[i]`: `guess_after` will be asked about request i's drafts (a proposer for which that
        costs work, a model's forward, does it only then)."""
        extras = extras or [None] * len(reqs)
        out = []
        for req, limit, extra in zip(reqs, limits, extras):
            if limit <= 0:
                out.append([])
            else:
                out.append(self.propose_for(req, limit) if extra is None else self.propose_after(req, extra, limit))
        return out

    def propose_after(self, req: Req, extra: list[int], limit: int) -> list[int]:
        """At most `limit` tokens continuing `req`'s known tokens and then `extra` (the drafts of its step in
        flight, as if all were accepted), the first a guess of the token that step samples after them."""
        raise NotImplementedError

    def guess_after(self, req: Req, drafts: list[int]) -> int | None:
        """The token this proposer would guess a verify step of `req` with `drafts` samples after them, all
        accepted (what an overlapped step after it would have assumed); None: no guess."""
        guess = self.propose_after(req, drafts, 1)
        return guess[0] if guess else None

    def retain(self, reqs: list[Req]) -> None:
        """Forget every request but `reqs` (those of this step)."""

    def rollback(self, req: Req) -> None:
        """A verify step's tokens are the request's now: drop what was kept for its rejected drafts."""

    def release(self, req: Req) -> None:
        """The request left the running requests (finished, aborted, retracted): free what it holds."""

    def is_idle(self) -> bool:
        """Nothing held for any request."""
        return True
