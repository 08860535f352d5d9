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

from pdserve.common.scheduling.batch import AfterStep, ForwardMode, RowWrite, ScheduleBatch
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
            # drafts never judged: dropped because the step before did not end as they assumed (a guess that
            # failed, or a request that finished there), or with their request (aborted, retracted)
            "spec_unconfirmed_tokens": 0,
            # verify steps scheduled while the step before them ran (with --speculative-overlap auto: while
            # the guesses hold)
            "spec_overlapped_steps": 0,
        }
        self.in_flight = 0  # verify steps launched and not processed

    def may_verify(self, batch_size: int) -> bool:
        """Whether a decode step of `batch_size` requests may be a verify step (the policy's limit)."""
        return batch_size > 0 and self.policy.speculates(batch_size)

    def report(self) -> dict[str, dict[str, int]]:
        """The counters since start, under the proposer's name (a server's load report)."""
        return {self.name: dict(self.stats)}

    def may_overlap(self, reqs: list[Req]) -> bool:
        """Whether a verify step of `reqs` may be scheduled while their previous step runs: the proposer
        drafts after a step in flight (`propose_after`), the policy says it pays (DraftPolicy.overlaps), and
        every request's sampling reads nothing but its step (SamplingParams.reads_step_only), with that one
        step at most in flight."""
        return (
            self.proposer.hypothesizes
            and self.policy.overlaps()
            and all(r.params.reads_step_only and r.pending <= 1 and not r.discard for r in reqs)
        )

    def verify_batch(self, reqs: list[Req], ends: list[int], row_writes: list[RowWrite]) -> ScheduleBatch | None:
        """The decode step of `reqs` (request i computes position ends[i] - 1, whose page it holds) as a
        verify step, or None when it may stay a plain decode step (no drafts, and no request's positions
        wait on a verify step in flight).

        A request with no step in flight is proposed drafts from its tokens. One whose previous step still
        runs (the overlapped verify step; `may_overlap` must hold) continues it: its positions move on the
        device by the drafts that step keeps, and its drafts are the proposer's guess of what follows that
        step's drafts all accepted (`propose_after`: its first token is a guess of that step's last; the
        device drops the drafts when the guess is wrong, common/engine/speculative/overlap.py).
        A grammar request gets none (speculation is off for structured outputs: its matcher must never see
        a rejected draft). A request whose drafts' pages are not available gets none this step: drafts
        never retract. A step larger than the policy's limit is a plain one, and each request is offered
        at most the policy's depth for it."""
        if not self.may_verify(len(reqs)):
            return None
        overlapped = any(req.pending for req in reqs)
        if overlapped and not self.may_overlap(reqs):
            # A plain step after plain steps in flight (the running requests were above the policy's limit when
            # Scheduler.results_first looked, and fewer run this step): right while no verify step in flight
            # may move positions, which results_first guarantees.
            assert not any(req.spec_ahead for req in reqs), "a verify step in flight: results must come first"
            return None
        self.proposer.retain(reqs)
        self.policy.retain(reqs)
        afters = [self._after(req) for req in reqs] if overlapped else [None] * len(reqs)
        limits = []
        for req, end, after in zip(reqs, ends, afters):
            # The step returns up to len(drafts) + 1 tokens: never more than the request may still
            # generate, counting all that the step in flight may keep.
            ahead = len(after.drafts) if after is not None else 0
            limit = min(req.params.max_new_tokens - req.num_sampled, self.context_length - end) - 1 - ahead
            limits.append(min(limit, self.policy.depth(req)) if req.grammar is None else 0)
        # A request with a step in flight is asked one token more: the guess of that step's last.
        asks = [n if a is None else n + 1 if n > 0 else 0 for a, n in zip(afters, limits)]
        extras = [a.drafts if a is not None else None for a in afters]
        guesses = [self.policy.may_guess(req, overlapped) for req in reqs]
        drafts = self.proposer.propose_batch(reqs, asks, extras, guesses)
        for i, after in enumerate(afters):
            if after is not None:
                if len(drafts[i]) > 1:
                    after.guess, drafts[i] = drafts[i][0], drafts[i][1:]
                else:
                    drafts[i] = []
        for i, (req, end, after) in enumerate(zip(reqs, ends, afters)):
            ahead = len(after.drafts) if after is not None else 0
            missing = pages_for(end + ahead + len(drafts[i]), self.kv.page_size) - len(req.pages)
            if drafts[i] and missing > self.kv.available_pages():
                drafts[i] = []
                if after is not None:
                    after.guess = -1
            self.kv.grow(req, end + ahead + len(drafts[i]))  # (the scheduler holds the pages up to end + ahead)
            req.kv_len = end + ahead + len(drafts[i])  # what the step may write
        moves = any(a is not None and a.drafts for a in afters)
        if not any(drafts) and not moves:
            return None
        if any(drafts):
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
            after=afters if overlapped else None,
        )

    @staticmethod
    def _after(req: Req) -> AfterStep | None:
        """What a request's step in flight leaves for the next (None: nothing in flight). Its drafts: none
        for a plain step or a prefill, and none for a verify step whose drafts continued a guess that the
        tokens since (all processed: only that step is in flight) did not confirm: it keeps none of them."""
        if not req.pending:
            return None
        drafts, prior = req.spec_inflight[-1][1:] if req.spec_inflight else ([], None)
        if prior is not None and prior.guess >= 0 and req.output_ids[prior.known :] != prior.drafts + [prior.guess]:
            drafts = []
        return AfterStep(req.future_idx, drafts, -1, len(req.output_ids))

    def on_launched(self, batch: ScheduleBatch, future_slots: list[int]) -> None:
        """The verify step is queued: each request has a result in flight, counted as one pending token
        until it arrives (it may keep more: `Req.spec_inflight`), whose last token and accepted count the
        device stores in its FutureMap slot."""
        self.in_flight += 1
        self.stats["spec_overlapped_steps"] += batch.after is not None
        afters = batch.after or [None] * len(batch.reqs)
        for req, drafts, slot, after in zip(batch.reqs, batch.drafts, future_slots, afters):
            req.pending += 1
            req.future_idx = slot
            req.spec_inflight.append((batch.seq, drafts, after))
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
        (common/engine/speculative/verify.py), none where they continued a guess the step before did
        not confirm (the device dropped them too). Returns the requests that finished."""
        self.in_flight -= 1
        done, row = [], 0
        afters = batch.after or [None] * len(batch.reqs)
        for req, drafts, taken, after in zip(batch.reqs, batch.drafts, accepted, afters):
            first, row = row, row + len(drafts) + 1
            req.pending -= 1
            req.spec_inflight = [e for e in req.spec_inflight if e[0] != batch.seq]
            if req.discard:  # finished in the step before, or aborted while the step ran: pages already freed
                req.discard -= 1
                self.stats["spec_unconfirmed_tokens"] += len(drafts)
                continue
            held = None
            if after is not None and after.guess >= 0:
                held = req.output_ids[after.known :] == after.drafts + [after.guess]
            elif after is None:  # (what an overlapped step after this one would have guessed)
                held = self._would_hold(req, drafts, taken, next_token_ids[first + taken])
            if held is not None:
                self.policy.record_guess(held)
            if after is not None and after.guess >= 0 and not held:
                taken = 0
                self.stats["spec_unconfirmed_tokens"] += len(drafts)
            elif drafts:
                self.stats["spec_accepted_tokens"] += taken
                self.stats["spec_verified_requests"] += 1
                self.policy.record(req, len(drafts), taken)
                req.spec_proposed += len(drafts)
                req.spec_accepted += taken
            req.sampled_steps += 1
            for j in range(first, first + taken + 1):
                append_token(req, next_token_ids[j], logprobs[j], self.eos_token_ids, self.context_length)
                if req.finished:
                    break
            known = len(req.prompt_ids) + len(req.output_ids)
            req.kv_len = known - 1  # every token kept but the newest has its KV written
            # (a step in flight writes positions known - 1 .. known - 1 + its drafts: their pages stay)
            self.kv.truncate(req, known + req.spec_ahead if req.pending else req.kv_len)
            if req.finished:
                done.append(req)  # (the scheduler releases it)
            else:
                self.proposer.rollback(req)
        return done

    def _would_hold(self, req: Req, drafts: list[int], taken: int, bonus: int) -> bool | None:
        """Judged on a verify step's result, before its tokens are the request's: would the guess of a step
        overlapped after it (all drafts kept, then the proposer's next token) have held? None: no guess
        (the proposer has none, or the policy never overlaps)."""
        if self.policy.overlap != "auto" or not self.proposer.hypothesizes:
            return None
        if taken < len(drafts):
            return False  # (whatever the guess: the step after assumed every draft kept)
        guess = self.proposer.guess_after(req, drafts)
        return None if guess is None else bonus == guess

    def release(self, req: Req) -> None:
        """`req` left the running requests (finished, aborted, retracted): the proposer frees what it holds."""
        self.proposer.release(req)

    def is_idle(self) -> bool:
        return self.proposer.is_idle()
