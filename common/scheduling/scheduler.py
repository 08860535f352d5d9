"""Continuous batching for an engine that prefills and decodes (colocated; the decode role builds on it).

Host only: it decides, the batch builder writes the device (common/engine/batch_builder.py). Its parts,
each one job:
    KVManager       rows, pages, the radix prefix cache              common/scheduling/kv_manager.py
    PrefillManager  waiting queue, chunked request, admission         common/scheduling/prefill_manager.py
    DecodeManager   the running batch, retraction                    common/scheduling/decode_manager.py
Prefill first: a step runs a prefill batch whenever something can be admitted (the chunked
request always continues first), otherwise a decode batch of everything running.

Finishing inserts a request's written KV into the cache and frees the rest; aborting frees without
caching; retraction caches what was written and sends the request back to waiting with its output
so far.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from pdserve.common.config import EngineConfig
from pdserve.common.scheduling.batch import ForwardMode, ScheduleBatch
from pdserve.common.scheduling.decode_manager import DecodeManager
from pdserve.common.scheduling.draft_policy import DraftPolicy
from pdserve.common.scheduling.kv_manager import KVManager
from pdserve.common.scheduling.output_processor import append_token, finalize, finalize_all, sampled_tokens
from pdserve.common.scheduling.pages import pages_for
from pdserve.common.scheduling.prefill_manager import PrefillManager
from pdserve.common.scheduling.speculation import Speculation
from pdserve.common.types import Completion, FinishReason, Req, SamplingParams, TokenLogprob

if TYPE_CHECKING:  # (the pools hold device memory: scheduling only calls their host-side methods)
    from pdserve.common.engine.kv_pool import PagedKVPool, ReqToTokenPool


def check_fits(config: EngineConfig, kv_pool: PagedKVPool, prompt_ids: Sequence[int], params: SamplingParams) -> None:
    """Raise ValueError when a request could never run on this engine."""
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    if params.resumed_output_tokens >= len(prompt_ids):
        raise ValueError(
            f"resumed_output_tokens ({params.resumed_output_tokens}) must be less than the prompt's "
            f"length ({len(prompt_ids)}): the prompt's tail is output already produced, after a prompt"
        )
    total = len(prompt_ids) + params.max_new_tokens
    if total > config.context_length:
        raise ValueError(
            f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({params.max_new_tokens}) "
            f"exceeds the context length {config.context_length}"
        )
    if pages_for(total, kv_pool.page_size) > kv_pool.capacity_pages:
        raise ValueError(f"the sequence needs more KV than the whole pool ({kv_pool.capacity_tokens} tokens)")


def extend_batch(spans, kv: KVManager) -> ScheduleBatch:
    """The prefill ScheduleBatch of (req, start, end) spans, carrying the rows decided since the last one."""
    reqs = [req for req, _, _ in spans]
    return ScheduleBatch(
        ForwardMode.EXTEND,
        reqs,
        [s for _, s, _ in spans],
        [e for _, _, e in spans],
        [end == req.seq_len for req, _, end in spans],
        kv.take_row_writes(),
        prompt_logprobs=prompt_logprob_spans(spans),
    )


def prompt_logprob_spans(spans) -> list[tuple[int, int, int]]:
    """(index, first, end) of the positions in each span whose logits score a prompt token not
    scored yet, for the requests that asked; marks them planned. Position p scores token p + 1, so
    a prompt of n tokens needs positions [0, n - 1). A prompt prefilled again (retracted, or
    resumed) is not scored twice."""
    out = []
    for i, (req, start, end) in enumerate(spans):
        if req.prompt_logprobs is None:
            continue
        first, last = max(start, req.prompt_logprobs_planned), min(end, len(req.prompt_ids) - 1)
        if last > first:
            out.append((i, first, last))
            req.prompt_logprobs_planned = last
    return out


def on_launched(batch: ScheduleBatch, future_slots: list[int]) -> None:
    """The batch's forward is queued: each sampling request now has a token in flight."""
    for req, sampling, slot in zip(batch.reqs, batch.samples, future_slots):
        if sampling:
            req.pending += 1
            req.future_idx = slot
            if req.finished:  # finished (or aborted) after this batch was built
                req.discard += 1


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        req_to_token_pool: ReqToTokenPool,
        kv_pool: PagedKVPool,
        eos_token_ids: tuple[int, ...],
        prefix_cache: bool | None = None,
        proposer=None,
    ):
        """`proposer`: speculative decoding's (common/scheduling/speculation.py), or None: decode steps
        are plain."""
        self.config = config
        self.eos_token_ids = eos_token_ids
        if prefix_cache is None:
            prefix_cache = not config.disable_radix_cache
        self.kv = KVManager(req_to_token_pool, kv_pool, prefix_cache, config.num_reserved_decode_tokens)
        self.prefill = PrefillManager(config, self.kv)
        self.decode = DecodeManager(config, self.kv, retract=self._retract)
        self.speculation = None
        if proposer is not None:
            policy = DraftPolicy(
                config.num_speculative_tokens,
                config.speculative_max_batch,
                not config.speculative_fixed_k,
                "off" if config.disable_overlap_schedule else config.speculative_overlap,  # (the serial loop)
            )
            self.speculation = Speculation(
                proposer, self.kv, config.context_length, eos_token_ids, policy, config.speculative
            )

    # Views for callers and tests.
    @property
    def waiting(self):
        return self.prefill.waiting

    @property
    def chunked_req(self) -> Req | None:
        return self.prefill.chunked_req

    @property
    def running(self) -> list[Req]:
        return self.decode.running

    @property
    def tree_cache(self):
        return self.kv.tree_cache

    @property
    def kv_pool(self) -> PagedKVPool:
        return self.kv.kv_pool

    @property
    def req_to_token_pool(self) -> ReqToTokenPool:
        return self.kv.req_to_token_pool

    @property
    def prefill_budget(self) -> int:
        return self.prefill.budget

    @property
    def stats(self) -> dict[str, int]:
        speculation = self.speculation.stats if self.speculation is not None else {}
        return self.prefill.stats | self.decode.stats | speculation

    # ---- intake -------------------------------------------------------------------------------

    def check_request(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        check_fits(self.config, self.kv.kv_pool, prompt_ids, params)

    def add_request(self, req: Req) -> None:
        self.check_request(req.prompt_ids, req.params)
        self.prefill.waiting.append(req)

    def abort(self, rid: str) -> Completion | None:
        """Remove a request wherever it is and free what it holds (nothing is cached)."""
        req = self.prefill.remove(rid) or self.decode.remove(rid)
        if req is None:
            return None
        req.finish_reason = FinishReason.ABORT
        req.discard = req.pending  # results still in flight are dropped on arrival
        self.kv.free(req)
        self._release_drafts(req)
        return finalize(req)

    def has_work(self) -> bool:
        return bool(self.decode.running) or self.prefill.has_work()

    def results_first(self) -> bool:
        """Whether the results in flight must be processed before the next batch is scheduled
        (EngineCore.get_next_batch_to_run): the next decode step may be a verify step (speculation is on,
        the running requests within its batch limit) that cannot continue their steps in flight
        (Speculation.may_overlap), or a verify step is in flight and the next decode step is a plain one,
        whose positions the host must know."""
        spec = self.speculation
        if spec is None:
            return False
        if spec.may_verify(len(self.decode.running)):
            return not spec.may_overlap(self.decode.running)
        return spec.in_flight > 0

    # ---- choosing the next batch ----------------------------------------------------------------

    def get_next_batch_to_run(self) -> ScheduleBatch | None:
        spans, completed = self.prefill.schedule(self.decode.running)
        # A completed prompt joins the running batch now: the next decode step feeds it a
        # placeholder for the token this prefill samples.
        self.decode.running += completed
        if spans:
            return extend_batch(spans, self.kv)
        return self.decode_step()

    def decode_step(self) -> ScheduleBatch | None:
        """A decode step of the running requests, or None when none runs (or none fits)."""
        if not self.decode.running:
            return None
        reqs, ends = self.decode.schedule()
        if not reqs:
            return None
        writes = self.kv.take_row_writes()
        if self.speculation is not None:
            batch = self.speculation.verify_batch(reqs, ends, writes)
            if batch is not None:
                return batch
        # Every request of a decode step samples its next token.
        return ScheduleBatch(ForwardMode.DECODE, reqs, [n - 1 for n in ends], ends, [True] * len(reqs), writes)

    def _retract(self, victim: Req) -> None:
        victim.kv_len = min(victim.kv_len, len(victim.prompt_ids) + len(victim.output_ids))  # (no drafts cached)
        self.kv.cache_and_release(victim)
        victim.spec_inflight = []
        self._release_drafts(victim)
        # A token still in flight is dropped when it arrives; the resumed prefill samples it again
        # at the same step with the same seed.
        victim.discard, victim.kv_len = victim.pending, 0
        self.prefill.waiting.appendleft(victim)

    def on_launched(self, batch: ScheduleBatch, future_slots: list[int]) -> None:
        if self.speculation is not None and batch.drafts is not None:
            self.speculation.on_launched(batch, future_slots)
            return
        on_launched(batch, future_slots)

    # ---- results --------------------------------------------------------------------------------

    def process_batch_result(
        self, batch: ScheduleBatch, next_token_ids: list[int], logprobs: list[TokenLogprob | None]
    ) -> list[Completion]:
        """Append each request's new token, retire the finished ones.

        Mid-prompt chunks sample nothing real; results for requests that finished, were aborted or
        were retracted after the batch was launched are dropped (req.discard). A finished request
        gives its KV back at once: anything still in flight that reads it is ordered before any
        later reuse by the forward stream and the WAR barrier.
        """
        done: list[Req] = []
        for req, token, lp in sampled_tokens(batch, next_token_ids, logprobs):
            if req.params.max_new_tokens == 0:  # only the prompt was asked for (its logprobs, say)
                req.finish_reason = FinishReason.LENGTH
            else:
                append_token(req, token, lp, self.eos_token_ids, self.config.context_length)
                req.sampled_steps += 1
            if req.finished:
                done.append(req)
        return self._retire(done)

    def process_verify_result(
        self, batch: ScheduleBatch, next_token_ids: list[int], logprobs: list[TokenLogprob | None], accepted: list[int]
    ) -> list[Completion]:
        """A verify step's result: each request's accepted drafts and the token after them
        (Speculation.process_result), then the finished retire as in process_batch_result."""
        return self._retire(self.speculation.process_result(batch, next_token_ids, logprobs, accepted))

    def _retire(self, done: list[Req]) -> list[Completion]:
        if not done:
            return []
        for req in done:
            # (a verify step in flight may have drafts past the known tokens: never cached)
            req.kv_len = min(req.kv_len, len(req.prompt_ids) + len(req.output_ids))
            self.kv.cache_and_release(req)
            self._release_drafts(req)
            req.discard = req.pending  # a step launched after this one is dropped
        self.decode.drop_finished()
        return finalize_all(done)

    def _release_drafts(self, req: Req) -> None:
        if self.speculation is not None:
            self.speculation.release(req)

    def kv_used_tokens(self) -> int:
        return self.kv.used_tokens()

    def num_running(self) -> int:
        return len(self.running)

    def is_idle(self) -> bool:
        """Nothing queued, every row back, and every page either free or cached and unlocked."""
        drafts_idle = self.speculation is None or self.speculation.is_idle()  # (a draft model's own KV)
        return not self.has_work() and self.kv.is_idle() and drafts_idle
