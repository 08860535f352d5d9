"""The runner side of the scheduler/runner seam: a ScheduleBatch becomes a ForwardBatch.

Every device write that scheduling needs happens here, and the event loop calls `build` inside
the schedule stream's context, so all of them queue on that stream (docs/architecture.md, "The
overlapped loop"): the req_to_token rows decided at admission (prefix hits, a decode server's reserved
pages), the rows of the batch's new tokens, and the one H2D upload of its inputs. After the WAR
barrier these writes wait on the GPU for the forward in flight, never on the host.

Two halves: `plan` is host work only (the values of the one upload, the host-side lengths: a
BatchPlan, plain data), `apply` makes the device writes. A TP server's rank 0 plans, and every rank
applies the same plan (common/engine/tp_worker.py).

NOTE: nothing here may read a device value back (`.item()`, `.tolist()`): the schedule stream is
chained behind the forward in flight, so a host sync would serialize the loop.
"""

from __future__ import annotations

import numpy as np

from pdserve.common.engine.batch import BatchPlan, ForwardBatch
from pdserve.common.engine.kv_pool import ReqToTokenPool
from pdserve.common.engine.overlap import h2d_array
from pdserve.common.engine.speculative.overlap import VerifySpec, moves, range_writes
from pdserve.common.scheduling.batch import ForwardMode, RowWrite, ScheduleBatch


class BatchBuilder:
    def __init__(self, req_to_token_pool: ReqToTokenPool, page_size: int):
        self.req_to_token_pool = req_to_token_pool
        self.page_size = page_size
        self.device = req_to_token_pool.req_to_token.device

    def build(self, batch: ScheduleBatch) -> ForwardBatch:
        return self.apply(self.plan(batch), batch.reqs)

    def plan(self, batch: ScheduleBatch) -> BatchPlan:
        """Host work only: what `apply` uploads and writes."""
        row_writes = self._row_writes(batch.row_writes) if batch.row_writes else None
        if batch.mode is ForwardMode.DECODE:
            return self._plan_decode(batch, row_writes)
        return self._plan_extend(batch, row_writes)

    def apply(self, plan: BatchPlan, reqs=()) -> ForwardBatch:
        """The device writes, on the current (schedule) stream: queued req_to_token rows, the one
        upload, the new tokens' rows."""
        if plan.row_writes is not None:
            w = h2d_array(plan.row_writes, self.device)
            self.req_to_token_pool.write_slots(w[0], w[1], w[2])
        packed = h2d_array(plan.packed, self.device)
        t, b = plan.num_tokens, len(plan.req_rows)
        if plan.mode is ForwardMode.DECODE:
            self.req_to_token_pool.write_slots(packed[3], packed[1], packed[2])
            ids, pos, loc, rows, lens, last = packed
            fields = dict(packed=packed)
        else:
            ids, pos, loc, tok_rows = packed[:t], packed[t : 2 * t], packed[2 * t : 3 * t], packed[3 * t : 4 * t]
            rows, last, lens = packed[4 * t : 4 * t + b], packed[4 * t + b : 4 * t + 2 * b], packed[4 * t + 2 * b :]
            self.req_to_token_pool.write_slots(tok_rows, pos, loc)
            fields = dict(packed=packed[: 3 * t].view(3, t))
        scored = None if plan.prompt_logprobs is None else h2d_array(plan.prompt_logprobs, self.device)
        spec = None
        if plan.verify_spec is not None:
            spec = VerifySpec.views(h2d_array(plan.verify_spec, self.device), b, t, plan.verify_moves)
        return ForwardBatch(
            mode=plan.mode,
            reqs=list(reqs),
            input_ids=ids,
            positions=pos,
            out_cache_loc=loc,
            req_pool_indices=rows,
            seq_lens=plan.seq_lens,  # shared with the ScheduleBatch: both are read-only once built
            extend_lens=plan.extend_lens,
            extend_starts=plan.extend_starts,
            req_rows=plan.req_rows,
            last_indices=last,
            samples=plan.samples,
            has_placeholders=plan.has_placeholders,
            seq_lens_dev=lens,
            seq=plan.seq,
            prompt_logprob_index=None if scored is None else scored[0],
            prompt_logprob_targets=None if scored is None else scored[1],
            prompt_top_n=plan.prompt_top_n,
            plan=plan,
            verify=plan.verify,
            spec=spec,
            **fields,
        )

    @staticmethod
    def _row_writes(writes: list[RowWrite]) -> np.ndarray | None:
        """All the rows decided since the last batch, for one upload and one scatter. Writes come in
        decision order and a scatter with repeated indices keeps no particular one, so a row written
        twice (freed and handed out again in between) is written only with its last contents."""
        last = {}
        for w in writes:
            last[w.row] = w  # NOTE: a later owner's write supersedes the earlier one whole
        rows = [w.row for w in last.values() for _ in w.slots]
        positions = [w.start + i for w in last.values() for i in range(len(w.slots))]
        slots = [s for w in last.values() for s in w.slots]
        return np.array([rows, positions, slots], dtype=np.int64) if slots else None

    def _plan_extend(self, batch: ScheduleBatch, row_writes) -> BatchPlan:
        # Per-token fields are built with numpy over the whole batch: a prefill batch can hold
        # tens of thousands of tokens, too many for per-token Python.
        page = self.page_size
        ids: list[int] = []
        page_table: list[int] = []  # the pages of each request's span, back to back
        page_base, extend_lens, extend_starts = [], [], []
        num_tokens = 0
        for i, (req, start, end) in enumerate(zip(batch.reqs, batch.starts, batch.ends)):
            extend_starts.append(num_tokens)
            num_tokens += end - start
            if batch.drafts is not None:  # a verify step: the last token, then the drafts (no fill_ids copy)
                ids.append(-req.future_idx if req.pending else (req.output_ids or req.prompt_ids)[-1])
                ids += batch.drafts[i]
            else:
                known = req.prompt_ids if end <= len(req.prompt_ids) else req.fill_ids()
                ids += known[start:end]
            # Only the pages of positions [start, end): a verify step's or a late chunk's few, not all
            first_page = start // page
            page_base.append(len(page_table) - first_page)
            page_table += req.pages[first_page : (end - 1) // page + 1]
            extend_lens.append(end - start)
        lens = np.asarray(extend_lens, dtype=np.int64)
        first = np.asarray(batch.starts, dtype=np.int64)
        positions = np.arange(num_tokens, dtype=np.int64) + np.repeat(
            first - np.asarray(extend_starts, dtype=np.int64), lens
        )
        page_index = np.repeat(np.asarray(page_base, dtype=np.int64), lens) + positions // page
        out_loc = np.asarray(page_table, dtype=np.int64)[page_index] * page + positions % page
        req_rows = [r.req_pool_idx for r in batch.reqs]
        last = [s + n - 1 for s, n in zip(extend_starts, extend_lens)]
        per_req = np.asarray(req_rows + last + batch.ends, dtype=np.int64)
        rows = np.repeat(np.asarray(req_rows, dtype=np.int64), lens)
        input_ids = np.asarray(ids, dtype=np.int64)
        verify_spec = None
        if batch.drafts is not None:  # (overlapped: its positions may move, so every slot they may reach)
            verify_spec = VerifySpec.plan(batch, extend_starts)
            ahead = range_writes(batch, page)
            if ahead is not None:
                row_writes = ahead if row_writes is None else np.concatenate([row_writes, ahead], axis=1)
        return BatchPlan(
            mode=ForwardMode.EXTEND,
            packed=np.concatenate([input_ids, positions, out_loc, rows, per_req]),
            num_tokens=num_tokens,
            seq_lens=batch.ends,
            extend_lens=extend_lens,
            extend_starts=extend_starts,
            req_rows=req_rows,
            samples=batch.samples,
            has_placeholders=bool(batch.drafts) and any(r.pending for r in batch.reqs),  # (an overlapped verify step)
            row_writes=row_writes,
            seq=batch.seq,
            prompt_logprobs=self._prompt_logprob_rows(batch, extend_starts),
            prompt_top_n=max((batch.reqs[i].params.prompt_logprobs for i, _, _ in batch.prompt_logprobs), default=0),
            verify=batch.drafts is not None,
            verify_spec=verify_spec,
            verify_moves=moves(batch),
        )

    @staticmethod
    def _prompt_logprob_rows(batch: ScheduleBatch, extend_starts: list[int]) -> np.ndarray | None:
        """[2, M]: the flat index of each position whose logits score a prompt token, and that token."""
        if not batch.prompt_logprobs:
            return None
        index, targets = [], []
        for i, first, end in batch.prompt_logprobs:
            base = extend_starts[i] - batch.starts[i]  # flat index of position 0 of request i
            index += range(base + first, base + end)
            targets += batch.reqs[i].prompt_ids[first + 1 : end + 1]
        return np.array([index, targets], dtype=np.int64)

    def _plan_decode(self, batch: ScheduleBatch, row_writes) -> BatchPlan:
        """One new token per request, at position seq_len - 1; the hot path of every decode step."""
        page = self.page_size
        positions = batch.starts
        input_ids, out_loc, req_rows = [], [], []
        for req, pos in zip(batch.reqs, positions):
            # The last token: a FutureMap placeholder while its value is still in flight.
            input_ids.append(-req.future_idx if req.pending else (req.output_ids or req.prompt_ids)[-1])
            out_loc.append(req.pages[pos // page] * page + pos % page)
            req_rows.append(req.req_pool_idx)
        b = batch.batch_size
        # Rows of one [6, B] upload: the CUDA-graph runner copies rows 0-4 in one strided copy.
        packed = np.array([input_ids, positions, out_loc, req_rows, batch.ends, range(b)], dtype=np.int64)
        return BatchPlan(
            mode=ForwardMode.DECODE,
            packed=packed,
            num_tokens=b,
            seq_lens=batch.ends,
            extend_lens=[1] * b,
            extend_starts=list(range(b)),
            req_rows=req_rows,
            samples=batch.samples,
            has_placeholders=any(t < 0 for t in input_ids),
            row_writes=row_writes,
            seq=batch.seq,
        )
