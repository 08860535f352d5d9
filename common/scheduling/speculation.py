"""The scheduling side of speculative decoding: a decode step's drafts and their pages, and what a
verify step's tokens do to its requests (docs/architecture.md, "Speculative decoding"). Host only; the
device side (sampling rows, acceptance) is common/engine/speculative/step.py.

A verify step is the decode step of the same requests as an EXTEND batch: request i computes its
last token and its k_i drafts, positions [n_i - 1, n_i + k_i), and each position samples (k_i = 0: the
one position of a plain decode). Its pages are taken for the drafts too, then rolled back to what the
accepted tokens wrote:

    KV written by the step   positions n-1 .. n-1+k   the last token, then the drafts
    valid after acceptance   positions n-1 .. n-1+a   the last token and the a accepted drafts
    kv_len after             n + a (+ nothing of the bonus token: the next step writes it)

NOTE the rejected drafts' KV lies past kv_len: its pages beyond the ones kv_len needs are freed at
once, and the slots left in the last kept page are written again before any query reads them (every
forward stores its new KV before it attends, and attends only up to its own positions). The radix
cache inserts only `fill_ids()[:kv_len]` (KVManager.cache_and_release), so it never sees a draft
that was not accepted.
"""

from __future__ import annotations

from pdserve.common.scheduling.batch import ForwardMode, RowWrite, ScheduleBatch
from pdserve.common.scheduling.draft_policy import DraftPolicy
from pdserve.common.scheduling.kv_manager import KVManager
from pdserve.common.scheduling.output_processor import append_token
from pdserve.common.scheduling.pages import pages_for
from pdserve.common.scheduling.proposer import Proposer
from pdserve.common.types import Req, TokenLogprob


class Speculation:
    """Drafts for decode steps from a proposer (proposer.py), passed in by the engine
    (common/engine/speculative/), which it tells when a request's tokens are settled after a verify step
    and when the request leaves (`release`: the scheduler calls it). `policy` says which steps
    speculate and how many drafts each request may get (draft_policy.py); `name`: the proposer's, for
    the metrics."""

    def __init__(
        self,
        proposer: Proposer,
        kv: KVManager,
        context_length: int,
        eos_token_ids: tuple[int, ...],
        policy: DraftPolicy,
        name: str = "",
    ):
        self.proposer = proposer
        self.kv = kv
        self.context_length = context_length
        self.eos_token_ids = eos_token_ids
        self.policy = policy
        self.name = name
        # spec_verified_requests: requests given drafts in a verify step whose result was processed (mean
        # accepted length: 1 + spec_accepted_tokens / spec_verified_requests, the tokens such a request gains)
        self.stats = {
            "spec_verify_steps": 0,
            "spec_proposed_tokens": 0,
            "spec_accepted_tokens": 0,
            "spec_verified_requests": 0,
        }

    def may_verify(self, batch_size: int) -> bool:
        """Whether a decode step of `batch_size` requests may be a verify step (the policy's limit)."""
        return batch_size > 0 and self.policy.speculates(batch_size)

    def report(self) -> dict[str, dict[str, int]]:
        """The counters since start, under the proposer's name (a server's load report)."""
        return {self.name: dict(self.stats)}

    def verify_batch(self, reqs: list[Req], ends: list[int], row_writes: list[RowWrite]) -> ScheduleBatch | None:
        """The decode step of `reqs` (request i computes position ends[i] - 1, whose page it holds) as a
        verify step, or None when no request has drafts (then it stays a plain decode step).

        Drafts are proposed only from tokens the host has: none of the requests may have one in flight
        (the engine processes results first: EngineCore.get_next_batch_to_run). A grammar request gets
        none (speculation is off for structured outputs: its matcher must never see a rejected draft).
        A request whose drafts' pages are not available gets none this step: drafts never retract.
        A step larger than the policy's limit is a plain one, and each request is offered at most the
        policy's depth for it."""
        if any(req.pending for req in reqs) or not self.may_verify(len(reqs)):
            return None
        self.proposer.retain(reqs)
        self.policy.retain(reqs)
        limits = []
        for req, end in zip(reqs, ends):
            # The step returns up to len(drafts) + 1 tokens: never more than the request may still generate.
            limit = min(req.params.max_new_tokens - req.num_sampled, self.context_length - end) - 1
            limits.append(min(limit, self.policy.depth(req)) if req.grammar is None else 0)
        drafts = self.proposer.propose_batch(reqs, limits)
        for i, (req, end) in enumerate(zip(reqs, ends)):
            missing = pages_for(end + len(drafts[i]), self.kv.page_size) - len(req.pages)
            if drafts[i] and missing > self.kv.available_pages():
                drafts[i] = []
            if drafts[i]:
                self.kv.grow(req, end + len(drafts[i]))
                req.kv_len = end + len(drafts[i])
        if not any(drafts):
            return None
        self.stats["spec_verify_steps"] += 1
        self.stats["spec_proposed_tokens"] += sum(len(d) for d in drafts)
        return ScheduleBatch(
            ForwardMode.EXTEND,
            reqs,
            [end - 1 for end in ends],
            [end + len(d) for end, d in zip(ends, drafts)],
            [True] * len(reqs),
            row_writes,
            drafts=drafts,
        )

    def on_launched(self, batch: ScheduleBatch) -> None:
        """The verify step is queued: each request has a result in flight, counted as one pending token
        until it arrives. NOTE no FutureMap slot: no later batch may read its tokens on the device (none
        is scheduled for these requests before the result is processed), and `future_idx` is left as it
        was, never read while this result is pending."""
        for req in batch.reqs:
            req.pending += 1
            if req.finished:  # (finished or aborted after the batch was built)
                req.discard += 1

    def process_result(
        self,
        batch: ScheduleBatch,
        next_token_ids: list[int],
        logprobs: list[TokenLogprob | None],
        accepted: list[int],
    ) -> list[Req]:
        """Give each request its accepted drafts and the token after them, in order, stopping where a
        token finishes it (EOS, a stop string, max_new_tokens: exactly the tokens a plain run returns),
        and roll its KV back to what they wrote. `next_token_ids` / `logprobs`: one per position, request
        after request; `accepted[i]`: request i's drafts equal to the samples before them
        (common/engine/speculative/verify.py). Returns the requests that finished."""
        done, row = [], 0
        for req, drafts, taken in zip(batch.reqs, batch.drafts, accepted):
            first, row = row, row + len(drafts) + 1
            req.pending -= 1
            if req.discard:  # aborted while the step ran: its pages are already freed
                req.discard -= 1
                continue
            self.stats["spec_accepted_tokens"] += taken
            self.stats["spec_verified_requests"] += bool(drafts)
            self.policy.record(req, len(drafts), taken)
            for j in range(first, first + taken + 1):
                append_token(req, next_token_ids[j], logprobs[j], self.eos_token_ids, self.context_length)
                if req.finished:
                    break
            req.kv_len = req.seq_len - 1  # every token kept but the newest has its KV written
            self.kv.truncate(req, req.kv_len)
            if req.finished:
                done.append(req)  # (the scheduler releases it)
            else:
                self.proposer.rollback(req)
        return done

    def release(self, req: Req) -> None:
        """`req` left the running requests (finished, aborted, retracted): the proposer frees what it holds."""
        self.proposer.release(req)

    def is_idle(self) -> bool:
        return self.proposer.is_idle()
