"""How many drafts speculative decoding offers each request of a decode step (docs/architecture.md,
"Speculative decoding"). It decides only how many drafts are verified, never a token: whatever it
says, every token is the plain engine's.

- Off above a batch size (--speculative-max-batch): verifying 1 + k positions per request costs about
  one plain step while the step is memory-bound (small batch), and k + 1 steps' compute once it is
  compute-bound; a decode step of more requests than the limit is a plain one.
- k lowered where drafts are rejected: each request keeps an exponential average of the fraction of
  its drafts accepted per verify step (starting at 1), and is offered average × k drafts (rounded),
  never fewer than 1; accepted drafts raise the average again, and k with it (a request at 1 draft whose
  draft is accepted is offered 2 the next step). --speculative-fixed-k turns this off.
- Overlapped verify steps only while they pay (--speculative-overlap auto): an overlapped step's drafts
  guess that the step in flight keeps all its drafts and then samples the proposer's next token; where
  the guess fails they are lost, and with partial acceptance every other step would lose them. So the
  policy keeps an average of how often that guess holds (or would have held, judged on each verify
  step's result while the loop runs serially), over all requests, and overlaps while it is at least
  OVERLAP_MIN_HELD; it starts serial.
"""

from __future__ import annotations

import math

from pdserve.common.types import Req

# The latest verify step's weight in a request's average acceptance: 0.5 halves the weight of each earlier
# step, so two steps with every draft rejected take k = 4 down to 1, and from 1 three steps with every draft
# accepted bring it back (1 -> 2 -> 3 -> 4).
ACCEPTANCE_WEIGHT = 0.5
# Overlap while this share of the guesses overlapped steps ride on holds (an average over requests and steps,
# each observation weighing HELD_WEIGHT). On an H200 (Llama-1B shape, drafts all right) overlapping made a
# verify step 11% cheaper; with one draft in three wrong it made steps lose their drafts half the time
# (docs/benchmarks/speculative.md, "The overlapped verify step"): it pays only when the guess nearly always holds.
OVERLAP_MIN_HELD = 0.8
HELD_WEIGHT = 1 / 16


class DraftPolicy:
    def __init__(self, num_tokens: int, max_batch: int = 0, adaptive: bool = True, overlap: str = "auto"):
        """`num_tokens`: k, the most drafts per request; `max_batch`: the largest decode step that
        speculates (0: any); `adaptive`: lower k for requests whose drafts are rejected; `overlap`: on, off,
        or auto (`overlaps`)."""
        self.num_tokens, self.max_batch, self.adaptive, self.overlap = num_tokens, max_batch, adaptive, overlap
        self.acceptance: dict[str, tuple[Req, float]] = {}  # rid -> (the request, its average acceptance)
        self.held = 0.0  # the average share of guesses that held (auto starts serial)

    def overlaps(self) -> bool:
        """Whether a verify step may be scheduled while the previous one runs (when its requests allow)."""
        return self.overlap == "on" or (self.overlap == "auto" and self.held >= OVERLAP_MIN_HELD)

    def record_guess(self, held: bool) -> None:
        """A guess an overlapped step rode on held or failed (or, judged on a serial step's result, would have)."""
        self.held += HELD_WEIGHT * (held - self.held)

    def may_guess(self, req: Req, overlapped: bool) -> bool:
        """Whether the proposer should know its guess after `req`'s drafts this step (Proposer.guess_after):
        when the next step may ride on it — this one is overlapped, or overlap is on — or, with auto, when
        the request's drafts are accepted often enough for a guess to hold (its rate at least the share of
        guesses that must hold), so that the serial steps' results tell whether overlapping would pay."""
        if self.overlap == "off":
            return False
        return overlapped or self.overlap == "on" or self.rate(req) >= OVERLAP_MIN_HELD

    def speculates(self, batch_size: int) -> bool:
        """Whether a decode step of `batch_size` requests gets drafts at all."""
        return self.max_batch == 0 or batch_size <= self.max_batch

    def rate(self, req: Req) -> float:
        """The request's average fraction of drafts accepted (1 before its first verify step)."""
        entry = self.acceptance.get(req.rid)
        return entry[1] if entry is not None and entry[0] is req else 1.0

    def depth(self, req: Req) -> int:
        """The most drafts `req` is offered this step: between 1 and k."""
        if not self.adaptive:
            return self.num_tokens
        return max(1, min(self.num_tokens, math.floor(self.rate(req) * self.num_tokens + 0.5)))

    def record(self, req: Req, proposed: int, accepted: int) -> None:
        """A verify step proposed `proposed` drafts for `req` and accepted `accepted` of them."""
        if proposed:
            rate = self.rate(req)
            self.acceptance[req.rid] = (req, rate + ACCEPTANCE_WEIGHT * (accepted / proposed - rate))

    def retain(self, reqs: list[Req]) -> None:
        """Forget every request but `reqs` (those of this step: the others ended)."""
        live = {req.rid for req in reqs}
        for rid in [rid for rid in self.acceptance if rid not in live]:
            del self.acceptance[rid]
