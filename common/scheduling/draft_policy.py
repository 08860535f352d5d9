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
"""

from __future__ import annotations

import math

from pdserve.common.types import Req

# The latest verify step's weight in a request's average acceptance: 0.5 halves the weight of each earlier
# step, so two steps with every draft rejected take k = 4 down to 1, and from 1 three steps with every draft
# accepted bring it back (1 -> 2 -> 3 -> 4).
ACCEPTANCE_WEIGHT = 0.5


class DraftPolicy:
    def __init__(self, num_tokens: int, max_batch: int = 0, adaptive: bool = True):
        """`num_tokens`: k, the most drafts per request; `max_batch`: the largest decode step that
        speculates (0: any); `adaptive`: lower k for requests whose drafts are rejected."""
        self.num_tokens, self.max_batch, self.adaptive = num_tokens, max_batch, adaptive
        self.acceptance: dict[str, tuple[Req, float]] = {}  # rid -> (the request, its average acceptance)

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
