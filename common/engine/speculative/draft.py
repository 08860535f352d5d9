"""The draft-model proposer (--speculative draft --draft-model-path DIR): a small model with the target's
vocabulary drafts k tokens greedily, one forward per draft, on the decode server (or the colocated
engine) with its own KV pool (draft_runner.py).

Each request speculating holds a row and pages of the draft pool, and the tokens whose draft KV they
hold (`DraftState.tokens`: positions [0, len)). Before drafting, the request's tokens the draft model
has not seen run through it (the whole prompt, in chunks, when the request first speculates; then the
tokens of the last step); then one-token forwards feed each draft back, the last one too where the
scheduler asks for the guess after them (`guesses`, DraftPolicy.may_guess: the overlapped loop, and
requests whose drafts are accepted often enough for it to hold): its argmax, `DraftState.next`, is the
guess an overlapped step after this one rides on, and that step's first draft without a forward of its
own. A forward of one token per
request (each feed-back; the catch-up when every request has one or two unseen tokens, as after a verify
step) is a DECODE forward, replayed from the draft model's CUDA graphs on a GPU; a catch-up with more
tokens for any request (the prompt) is an eager EXTEND forward:

    draft KV written     positions 0 .. n-1+k   the request's n tokens, then drafts 1 .. k (k - 1 serially)
    kept after verify    the longest prefix equal to the request's tokens (its accepted drafts), and past
                         them what agrees with them so far (a proposal for the step in flight, below)

so a rejected draft's KV is dropped exactly as the target's is (`rollback`, after each verify step, and
again before drafting: a proposal the scheduler dropped for want of target pages leaves KV that no
verify step rolled back). Pages past the kept positions are freed; a request's row and pages go back
when it leaves (`release`). When the draft pool has no room for a request, that request gets no drafts
this step (never an error, never a retraction).

In the overlapped loop a verify step is proposed while the request's previous one still runs
(`propose_after`): the drafts continue the request's tokens and that step's drafts as if all were
accepted, and the first is the draft's guess of that step's bonus token; `settled` stays at the
request's own tokens, since what follows them is a hypothesis until the step's result arrives. The draft
forwards run on the draft model's own stream (DraftRunner.drafting), beside the target's verify step.

One host read per verify step: the drafts, all requests' together, after the last draft forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pdserve.common.config import EngineConfig
from pdserve.common.engine.overlap import h2d
from pdserve.common.engine.speculative.draft_memory import draft_pool_pages, draft_rows
from pdserve.common.engine.speculative.draft_runner import DraftRunner
from pdserve.common.scheduling.pages import pages_for, slots_for_positions
from pdserve.common.scheduling.proposer import Proposer
from pdserve.common.types import Req, SamplingParams


@dataclass
class DraftState:
    """One request's share of the draft pool."""

    req: Req
    row: int
    pages: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # the tokens at the positions whose draft KV is written
    settled: int = 0  # how many leading `tokens` are the request's own (not drafts): never compared again
    next: int | None = None  # the draft model's argmax after all of `tokens` (None: not known)


class DraftProposer(Proposer):
    hypothesizes = True  # (propose_after: drafts after the drafts of a step in flight)

    def __init__(self, config: EngineConfig, device: torch.device, target_pages: int):
        """A draft pool with a row for each request a verify step may have (--speculative-max-batch, else
        --max-running-requests) and pages for all of them at full context, no more than the target's
        (`target_pages`). NOTE only a verify step's requests hold draft KV (`retain` frees the others'
        before each proposal), so its rows and pages run out only where the target's pool is smaller."""
        self.num_tokens = config.num_speculative_tokens
        self.page_size = config.page_size
        # the most tokens one forward computes while a request catches up (its prompt, the first time)
        self.chunk = config.chunked_prefill_size if config.chunked_prefill_size > 0 else config.max_prefill_tokens
        pages = min(target_pages, draft_pool_pages(config))  # (the target left room for the most: draft_memory.py)
        self.runner = DraftRunner(config, device, draft_rows(config), 1 + pages)
        self.states: dict[str, DraftState] = {}
        if device.type == "cuda":
            self.warmup()

    def warmup(self) -> None:
        """Draft for dummy requests (one, then three of other lengths) and free them: the draft model's
        kernels compile before the first request speculates (on CUDA, at start-up)."""
        params = SamplingParams(max_new_tokens=self.num_tokens + 1)
        longest = max(1, self.runner.req_to_token_pool.context_len - self.num_tokens)
        lengths = [min(n, longest) for n in [min(self.chunk, 64), 7, 16, 27][: 1 + self.runner.req_to_token_pool.size]]
        for batch in (lengths[:1], lengths[1:]):
            reqs = [Req(f"warmup-{i}", [0] * n, params, seed=0) for i, n in enumerate(batch)]
            self.propose_batch(reqs, [self.num_tokens] * len(reqs))
            for req in reqs:
                self.release(req)

    # ---- who holds what -------------------------------------------------------------------------

    def _state(self, req: Req) -> DraftState | None:
        state = self.states.get(req.rid)
        if state is not None and state.req is not req:  # the rid used again by another request
            self.release(state.req)
            state = None
        if state is None:
            row = self.runner.req_to_token_pool.alloc()
            if row is None:
                return None
            state = self.states[req.rid] = DraftState(req, row)
        return state

    def _keep(self, state: DraftState, tokens: list[int], longer: bool = False) -> None:
        """Keep the draft KV of the longest prefix of `state.tokens` equal to `tokens` (the request's, which
        only grow, and perhaps its step in flight's drafts); free the pages past it. `longer`: keep past
        `tokens` too while they agree (what a proposal for a step still in flight assumed). Compares the
        drafts only: O(k), not O(context)."""
        start = state.settled
        drafted = zip(state.tokens[start:], tokens[start:])
        kept = next((start + n for n, (have, real) in enumerate(drafted) if have != real), None)
        if kept is None:
            kept = len(state.tokens) if longer else min(len(state.tokens), len(tokens))
        self._cut(state, kept)

    def _cut(self, state: DraftState, kept: int) -> None:
        """Forget the draft KV past the first `kept` tokens (never below `settled`)."""
        if kept < len(state.tokens):
            del state.tokens[kept:]
            state.next = None
            state.settled = min(state.settled, kept)
        keep = pages_for(kept, self.page_size)
        self.runner.kv_pool.free_pages(state.pages[keep:])
        del state.pages[keep:]

    def rollback(self, req: Req) -> None:
        """After a verify step: keep what agrees with the request's tokens (past them too, when the request's
        next step, already in flight, was proposed after this one's drafts)."""
        state = self.states.get(req.rid)
        if state is not None and state.req is req:
            known = req.prompt_ids + req.output_ids
            self._keep(state, known, longer=True)
            state.settled = min(len(state.tokens), len(known))

    def release(self, req: Req) -> None:
        state = self.states.get(req.rid)
        if state is None or state.req is not req:
            return
        del self.states[req.rid]
        self.runner.kv_pool.free_pages(state.pages)
        self.runner.req_to_token_pool.free(state.row)

    def retain(self, reqs: list[Req]) -> None:
        live = {id(req) for req in reqs}
        for state in [s for s in self.states.values() if id(s.req) not in live]:
            self.release(state.req)

    def is_idle(self) -> bool:
        rows, pool = self.runner.req_to_token_pool, self.runner.kv_pool
        return not self.states and rows.available() == rows.size and pool.num_free_pages() == pool.capacity_pages

    # ---- drafting -------------------------------------------------------------------------------

    def propose_for(self, req: Req, limit: int) -> list[int]:
        return self.propose_batch([req], [limit])[0]

    def propose_after(self, req: Req, extra: list[int], limit: int) -> list[int]:
        return self.propose_batch([req], [limit], [extra])[0]

    def guess_after(self, req: Req, drafts: list[int]) -> int | None:
        """The draft's argmax after `drafts` when its last proposal for `req` was them (and fed them all)."""
        state = self.states.get(req.rid)
        if state is None or state.req is not req or state.next is None:
            return None
        n = len(req.prompt_ids) + len(req.output_ids)
        return state.next if len(state.tokens) == n + len(drafts) and state.tokens[n:] == drafts else None

    def propose_batch(
        self,
        reqs: list[Req],
        limits: list[int],
        extras: list[list[int] | None] | None = None,
        guesses: list[bool] | None = None,
    ) -> list[list[int]]:
        """Drafts for every request with a positive limit, in one batch of forwards on the draft model's
        stream (DraftRunner.drafting: never behind the target's step in flight). Request i's drafts continue
        its tokens, then `extras[i]` where given (its step in flight's drafts, all accepted: the first draft
        is then the guess of that step's last token, speculation.py). Where `guesses[i]`, its last draft is
        fed back too (one forward more): its argmax, `next`, is the guess after the drafts (`guess_after`)
        and the first draft of an overlapped step after this one, without a forward of its own."""
        extras = extras or [None] * len(reqs)
        guesses = guesses or [False] * len(reqs)
        jobs = []  # (index, state, the tokens drafted after, k, how many of them are the request's own, feeds)
        for i, (req, limit, extra, guess) in enumerate(zip(reqs, limits, extras, guesses)):
            k = min(self.num_tokens + (extra is not None), limit)
            state = self._state(req) if k > 0 else None
            if state is None:
                continue
            known = req.prompt_ids + req.output_ids
            tokens = known + extra if extra else known
            self._keep(state, tokens)
            if len(state.tokens) == len(tokens) and state.next is None:
                self._cut(state, len(tokens) - 1)  # (the last token runs again: its logits give the first draft)
            feeds = k if guess else k - 1  # the drafts fed back: a forward each
            missing = pages_for(len(tokens) + feeds, self.page_size) - len(state.pages)
            pages = self.runner.kv_pool.alloc_pages(max(missing, 0))
            if pages is None:
                continue  # no room in the draft pool this step: no drafts for this request
            state.pages += pages
            jobs.append((i, state, tokens, k, len(known), feeds))
        drafts: list[list[int]] = [[] for _ in reqs]
        if not jobs:
            return drafts
        # Deepest first: the requests still drafting at step j are a prefix of the jobs (slices, not gathers).
        jobs.sort(key=lambda job: -job[5])
        with self.runner.drafting():
            columns = [self._first(jobs)]  # draft 1 of every job, on the device
            for j in range(1, jobs[0][5] + 1):  # feed draft j back
                live = jobs[: sum(job[5] >= j for job in jobs)]
                columns.append(  # one token per request: a DECODE forward (a CUDA-graph replay where captured)
                    self.runner.decode(
                        columns[-1][: len(live)],
                        [job[1].row for job in live],
                        [len(job[2]) + j - 1 for job in live],
                        [self._slot(job[1], len(job[2]) + j - 1) for job in live],
                    )
                )
            flat = torch.cat(columns).tolist()  # NOTE the one host read: every job's drafts, column after column
        offsets = [0]
        for column in columns:
            offsets.append(offsets[-1] + column.numel())
        for n, (i, state, tokens, k, known, feeds) in enumerate(jobs):
            out = [flat[offsets[j] + n] for j in range(1 + feeds)]
            drafts[i] = out[:k]
            state.tokens = tokens + out[:feeds]  # the KV written: the tokens and every draft fed back
            state.next = out[k] if feeds == k else None
            state.settled = known
        return drafts

    def _first(self, jobs) -> torch.Tensor:
        """Each job's first draft [J] on the device: its `next` where the draft KV covers all its tokens
        already (the proposal before fed them), else from a catch-up forward."""
        behind = [n for n, job in enumerate(jobs) if len(job[1].tokens) < len(job[2])]
        if len(behind) == len(jobs):
            return self._catch_up(jobs)
        device = self.runner.device
        first = h2d([job[1].next if len(job[1].tokens) == len(job[2]) else 0 for job in jobs], torch.int64, device)
        if behind:
            first[h2d(behind, torch.int64, device)] = self._catch_up([jobs[n] for n in behind])
        return first

    def _slot(self, state: DraftState, position: int) -> int:
        return state.pages[position // self.page_size] * self.page_size + position % self.page_size

    def _catch_up(self, jobs) -> torch.Tensor:
        """Run each job's tokens the draft model has not seen (at least its last one), in forwards of at
        most `chunk` tokens; returns each job's argmax after its last token [J], on the device. When every
        job has one or two such tokens (after a verify step: its bonus token, and, where the last draft was
        not fed back, that draft when all were accepted), DECODE forwards (graph replays on CUDA): one more
        first for the jobs with two."""
        unseen = [len(tokens) - len(state.tokens) for _, state, tokens, *_ in jobs]
        if all(n in (1, 2) for n in unseen):
            # Two unseen (after a step that accepted all k drafts: the last draft and the bonus token):
            # the first of them in a DECODE forward of those jobs alone (its argmax is not needed), so
            # the catch-up stays two graph replays instead of an eager EXTEND forward.
            two = [job for job, n in zip(jobs, unseen) if n == 2]
            if two:
                self.runner.decode(
                    [tokens[-2] for _, _, tokens, *_ in two],
                    [state.row for _, state, *_ in two],
                    [len(tokens) - 2 for _, _, tokens, *_ in two],
                    [self._slot(state, len(tokens) - 2) for _, state, tokens, *_ in two],
                )
            return self.runner.decode(
                [tokens[-1] for _, _, tokens, *_ in jobs],
                [state.row for _, state, *_ in jobs],
                [len(tokens) - 1 for _, _, tokens, *_ in jobs],
                [self._slot(state, len(tokens) - 1) for _, state, tokens, *_ in jobs],
            )
        firsts: list[torch.Tensor | None] = [None] * len(jobs)
        todo = [(n, len(state.tokens)) for n, (_, state, *_) in enumerate(jobs)]  # (job, next position)
        while todo:
            batch, budget, rest = [], self.chunk, []
            for n, start in todo:
                end = len(jobs[n][2])
                take = min(end - start, budget)
                if take > 0:
                    batch.append((n, start, take))
                    budget -= take
                if start + max(take, 0) < end:
                    rest.append((n, start + max(take, 0)))
            states = [jobs[n][1] for n, _, _ in batch]
            ids = [t for n, s, take in batch for t in jobs[n][2][s : s + take]]
            slots = []
            for (_, s, take), state in zip(batch, states):
                slots += slots_for_positions(state.pages, s, s + take, self.page_size)
            out = self.runner.greedy(
                h2d(ids, torch.int64, self.runner.device),
                [state.row for state in states],
                [s for _, s, _ in batch],
                [take for _, _, take in batch],
                slots,
            )
            for m, (n, s, take) in enumerate(batch):
                if s + take == len(jobs[n][2]):
                    firsts[n] = out[m : m + 1]
            todo = rest
        return torch.cat(firsts)
