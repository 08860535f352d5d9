"""The prefill role's scheduler: prefill, sample the first token, WRITE the KV to the decode server.

A request arrives with its destination (the decode server's agent, its pages, the room), or
gets it later (`set_destination`: the router asks the decode server for pages and starts the
prefill at the same time). It is scheduled like any colocated prefill — radix-cache prefix reuse,
chunking — but never decodes. A request whose prefill is done before its destination is known is
parked, holding its pages, until the destination arrives (or the KV transfer timeout passes).
When its last chunk's result is processed (so the forward that wrote its KV has completed: the
result's copy_done event is recorded after it), the KV pages covering its prompt are written into
the destination pages over the transfer agent (every TP rank its KV heads: KVSender), with a
notification carrying the room and the first token. The request keeps its pages until every
rank's WRITE is done (or one failed, or its deadline passed); then its KV is cached (or freed)
and its result reported.

A destination expires (KVDestination.expires_unix_s): the decode server fails the request then,
and KV_WRITE_GRACE_S later gives its pages to other requests. No WRITE starts after the expiry,
none runs past half the grace, and a request still queued or prefilling at the expiry fails at
once (its prefill would be wasted work: the decode server has given up on it).
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from dataclasses import dataclass

from pdserve.common.config import EngineConfig
from pdserve.common.engine.kv_pool import PagedKVPool, ReqToTokenPool
from pdserve.common.errors import ErrorCode
from pdserve.common.kv_transfer import KVTransferError, TransferState
from pdserve.common.scheduling.batch import ScheduleBatch
from pdserve.common.scheduling.kv_manager import KVManager
from pdserve.common.scheduling.output_processor import sampled_tokens
from pdserve.common.scheduling.pages import pages_for
from pdserve.common.scheduling.prefill_manager import PrefillManager
from pdserve.common.scheduling.scheduler import check_fits, extend_batch, on_launched
from pdserve.common.types import KV_WRITE_GRACE_S, FinishReason, Req, SamplingParams, TokenLogprob


@dataclass
class Destination:
    """Where a request's KV goes: the peer agent and its pages, in position order, for the
    prompt's positions from prefix_len on (the peer holds the KV before it: a multiple of the page
    size)."""

    peer: str
    page_ids: list[int]
    expires: float = math.inf  # time.monotonic() past which no WRITE may start
    prefix_len: int = 0
    writing: bool = False  # its WRITE started


@dataclass
class PrefillResult:
    """What the prefill server answers for one request."""

    rid: str
    room: int
    first_token: int | None
    first_logprob: TokenLogprob | None
    prompt_tokens: int
    cached_tokens: int
    transfer_bytes: int = 0
    transfer_s: float = 0.0  # from the WRITE's start to its completion
    transfer_ops: int = 0  # what rank 0's WRITEs posted: NIXL descriptors, or device-copy launches
    transfer_path: str = ""  # "nixl" or "device_copy" (TransferHandle.path)
    error: str | None = None  # None: the KV and the first token are at the decode server
    error_code: ErrorCode | None = None  # set with `error`
    queue_s: float = 0.0  # from its arrival to its first prefill batch
    prefill_s: float = 0.0  # from its first prefill batch to its first token
    destination_wait_s: float = 0.0  # from its first token to its transfer's start (parked: no destination yet)
    transfer_pages: int = 0  # KV pages written to the decode server
    prefill_chunks: int = 0  # prefill batches its prompt was computed in
    chunk_s: tuple[float, ...] = ()  # each batch's share of prefill_s: from its scheduling to the next's
    prompt_logprobs: list[TokenLogprob | None] | None = None  # when asked: one per prompt token, None first


@dataclass
class _Transfer:
    req: Req
    handle: object
    started: float
    deadline: float


@dataclass
class _Parked:
    """Prefilled, waiting for its destination; the first token is ready to send."""

    req: Req
    token: int
    logprob: TokenLogprob | None
    deadline: float


class PrefillScheduler:
    """Prefill-only admission (no request decodes here, so none reserves decode room) plus the
    destinations, the parked requests and the transfers in flight."""

    def __init__(
        self,
        config: EngineConfig,
        req_to_token_pool: ReqToTokenPool,
        kv_pool: PagedKVPool,
        sender,
        kv_transfer_timeout: float,
    ):
        self.config = config
        self.kv = KVManager(req_to_token_pool, kv_pool, not config.disable_radix_cache, reserve_decode_tokens=0)
        self.prefill = PrefillManager(config, self.kv)
        self.sender = sender  # common/kv_transfer/sender.py KVSender
        self.kv_transfer_timeout = kv_transfer_timeout
        self.destinations: dict[str, Destination] = {}  # rid -> destination
        self.transfers: list[_Transfer] = []
        self.parked: dict[str, _Parked] = {}  # rid -> prefilled, destination not known yet
        self.live: dict[str, Req] = {}  # every request from its arrival until its result
        self.expiring: list[tuple[float, int, str, Destination]] = []  # heap of (expires, seq, rid, dest)
        self._seq = itertools.count()
        self.done: list[PrefillResult] = []  # results not yet collected
        self._destined_first = False  # a destination came for a queued request: reorder the queue

    def check_request(self, prompt_ids, params: SamplingParams) -> None:
        check_fits(self.config, self.kv.kv_pool, prompt_ids, params)

    def add_prefill_request(self, req: Req, destination: Destination | None) -> None:
        """Queue a request; without a destination, `set_destination` must follow."""
        self.check_request(req.prompt_ids, req.params)
        if destination is not None:
            self._check_destination(req, destination)
            self._set(req.rid, destination)
            self._destined_first = bool(self.prefill.waiting)
        self.live[req.rid] = req
        self.prefill.waiting.append(req)

    def get_next_batch_to_run(self) -> ScheduleBatch | None:
        self._fail_expired(time.monotonic())  # never compute a prompt whose KV can no longer be written
        if self._destined_first:
            self._destined_first = False
            self._order_by_destination()
        spans, _ = self.prefill.schedule([])  # a finished prompt waits for its result, then transfers
        return extend_batch(spans, self.kv) if spans else None

    def on_launched(self, batch: ScheduleBatch, future_slots: list[int]) -> None:
        on_launched(batch, future_slots)

    def kv_used_tokens(self) -> int:
        return self.kv.used_tokens()

    def num_running(self) -> int:
        return 0  # a prefill server runs none: each prompt leaves with its first token

    @property
    def stats(self) -> dict[str, int]:
        return self.prefill.stats

    def set_destination(self, rid: str, destination: Destination, now: float) -> None:
        """The destination of a request queued without one; starts its transfer if it is parked.
        Raises ValueError (and changes nothing) for pages too few for its prompt; ignores an
        unknown request (aborted or finished meanwhile)."""
        req = self.live.get(rid)
        if req is None or req.finished or rid in self.destinations:
            return
        self._check_destination(req, destination)
        self._set(rid, destination)
        parked = self.parked.pop(rid, None)
        if parked is not None:
            self._start_transfer(req, parked.token, parked.logprob, now)
        else:
            self._destined_first = True

    def _order_by_destination(self) -> None:
        """Queued requests whose decode server has granted pages go first (first come, first served
        among each): in a burst the decode server grants only what it can hold, and prompts
        prefilled before their grant wait parked, holding pages, while granted ones wait to be
        prefilled (the first decode batch then starts late)."""
        waiting = self.prefill.waiting
        if len(waiting) > 1:
            ordered = sorted(waiting, key=lambda r: r.rid not in self.destinations)  # stable
            waiting.clear()
            waiting.extend(ordered)

    def _set(self, rid: str, destination: Destination) -> None:
        self.destinations[rid] = destination
        if destination.expires < math.inf:
            heapq.heappush(self.expiring, (destination.expires, next(self._seq), rid, destination))

    def _check_destination(self, req: Req, destination: Destination) -> None:
        """ValueError unless the destination's pages cover the prompt after its prefix. NOTE: the
        prefix length comes through the router: one the decode server did not grant (larger, or
        off a page boundary) is refused here, and a WRITE of another page count than its grant is
        refused there (decode/arrivals.py): a forged prefix never decides what the decode reads."""
        prefix, page = destination.prefix_len, self.kv.page_size
        if prefix % page or not 0 <= prefix <= len(req.prompt_ids):
            raise ValueError(
                f"the destination's prefix_len {prefix} is not a multiple of the page size {page} within "
                f"the prompt ({len(req.prompt_ids)} tokens)"
            )
        need = pages_for(len(req.prompt_ids), page) - prefix // page
        if len(destination.page_ids) != need:
            raise ValueError(
                f"the destination has {len(destination.page_ids)} pages; the prompt needs {need} after its "
                f"first {prefix} tokens"
            )

    def has_work(self) -> bool:
        # Parked requests keep the loop polling: their deadlines are checked in poll_transfers.
        return bool(self.transfers or self.parked) or self.prefill.has_work()

    def process_batch_result(self, batch, next_token_ids: list[int], logprobs: list[TokenLogprob | None]):
        """Each finished prompt starts its KV WRITE; nothing finishes here (see poll_transfers)."""
        now = time.monotonic()
        for req, token, lp in sampled_tokens(batch, next_token_ids, logprobs):
            req.prefilled = now
            if req.finish_reason is FinishReason.ABORT:  # aborted while its last chunk ran: answered then
                self._finish(req)
                continue
            if req.params.max_new_tokens == 0:  # only the prompt was asked for: no KV goes anywhere
                self._finish(req)
                continue
            req.output_ids.append(token)
            if lp is not None:
                req.output_logprobs.append(lp)
            if req.rid in self.destinations:
                self._start_transfer(req, token, lp, now)
            else:  # the decode server has not answered yet
                self.parked[req.rid] = _Parked(req, token, lp, now + self.kv_transfer_timeout)
        return []

    def _start_transfer(self, req: Req, token: int, lp: TokenLogprob | None, now: float) -> None:
        dest = self.destinations[req.rid]
        if now > dest.expires:
            self._finish(req, error=_expired(dest, now), error_code=ErrorCode.KV_TRANSFER_TIMEOUT)
            return
        n = pages_for(len(req.prompt_ids), self.kv.page_size)
        held = dest.prefix_len // self.kv.page_size  # the decode server's own: not sent
        top = {"token_id": lp.token_id, "logprob": lp.logprob, "top": lp.top} if lp is not None else None
        try:
            # The notifications' counts let the decode server check each WRITE against its grant.
            handle = self.sender.write(
                dest.peer, req.pages[held:n], dest.page_ids, room=req.room, first_token=token, logprobs=top
            )
        except (KVTransferError, ValueError) as e:  # fails this request, not the server (a dead TP rank does)
            self._finish(
                req, error=f"KV transfer to {dest.peer} could not start: {e}", error_code=ErrorCode.KV_TRANSFER_FAILED
            )
            return
        dest.writing = True
        # A WRITE still running half the grace past the expiry is given up: the pages are about
        # to go to another request.
        deadline = min(now + self.kv_transfer_timeout, dest.expires + KV_WRITE_GRACE_S / 2)
        self.transfers.append(_Transfer(req, handle, now, deadline))

    def poll_transfers(self, now: float) -> list[PrefillResult]:
        """Finish the transfers the agent reports done, failed or late, and the parked requests
        whose destination never came; never blocks."""
        # (parked in deadline order: each deadline is its parking time plus the one timeout, and a
        # burst parks hundreds, so the scan stops at the first one still waiting)
        while self.parked and now > (oldest := next(iter(self.parked.values()))).deadline:
            del self.parked[oldest.req.rid]
            self._finish(
                oldest.req,
                error=f"no KV destination came within {self.kv_transfer_timeout:g}s",
                error_code=ErrorCode.KV_TRANSFER_TIMEOUT,
            )
        self._fail_expired(now)
        still = []
        for t in self.transfers:
            state = self.sender.poll(t.handle)
            if state is TransferState.IN_PROGRESS and now <= t.deadline:
                still.append(t)
                continue
            # NOTE: releasing cancels every rank's WRITE still running (before any later forward
            # can reuse the pages); only then are the pages freed or cached, in _finish.
            self.sender.release(t.handle)
            if state is TransferState.DONE:
                self._finish(t.req, written=t.handle, transfer_s=now - t.started)
            elif state is TransferState.FAILED:
                self.sender.remove_peer(t.handle.peer)  # its cached metadata may be stale (a restarted server)
                self._finish(t.req, error=self.sender.failure(t.handle), error_code=ErrorCode.KV_TRANSFER_FAILED)
            elif t.deadline < t.started + self.kv_transfer_timeout:
                self._finish(
                    t.req, error=_expired(self.destinations[t.req.rid], now), error_code=ErrorCode.KV_TRANSFER_TIMEOUT
                )
            else:
                self._finish(
                    t.req,
                    error=f"KV transfer timed out after {self.kv_transfer_timeout:g}s",
                    error_code=ErrorCode.KV_TRANSFER_TIMEOUT,
                )
        self.transfers = still
        done, self.done = self.done, []
        return done

    def _fail_expired(self, now: float) -> None:
        """Fail the requests, queued or prefilling, whose destination can no longer be written."""
        while self.expiring and self.expiring[0][0] < now:
            _, _, rid, dest = heapq.heappop(self.expiring)
            if self.destinations.get(rid) is not dest or dest.writing:
                continue  # finished meanwhile, or its transfer keeps its own deadline
            result = self.abort(rid)  # frees it wherever it is, as a client's cancel would
            if result is not None:
                result.error, result.error_code = _expired(dest, now), ErrorCode.KV_TRANSFER_TIMEOUT
                self.done.append(result)

    def _finish(
        self,
        req: Req,
        error: str | None = None,
        error_code: ErrorCode | None = None,
        written=None,
        transfer_s: float = 0.0,
    ) -> None:
        """Cache (on success) or free the request's KV and record its result (an aborted request
        was answered when it was aborted). `written`: its transfer's handle, once it is done."""
        aborted = req.finish_reason is FinishReason.ABORT
        if error is None and not aborted:
            req.kv_len = len(req.prompt_ids)  # the prompt's KV; the first token's is the decode's job
            self.kv.cache_and_release(req)
        else:
            self.kv.free(req)
        dest = self.destinations.pop(req.rid, None)
        self.live.pop(req.rid, None)
        if aborted:
            return
        ok, now = error is None, time.monotonic()
        # (0 for a stage it never reached: failed or aborted before it)
        prefilled = req.prefilled or now
        self.done.append(
            PrefillResult(
                rid=req.rid,
                room=req.room,
                first_token=req.output_ids[0] if ok and req.output_ids else None,
                first_logprob=req.output_logprobs[0] if ok and req.output_logprobs else None,
                prompt_tokens=len(req.prompt_ids),
                cached_tokens=req.cached_tokens,
                transfer_bytes=written.num_bytes if written else 0,
                transfer_s=transfer_s,
                transfer_ops=written.ops if written else 0,
                transfer_path=written.path if written else "",
                error=error,
                error_code=error_code,
                queue_s=max(req.admitted - req.arrived, 0.0) if req.admitted else 0.0,
                prefill_s=max(prefilled - req.admitted, 0.0) if req.admitted else 0.0,
                destination_wait_s=max(now - transfer_s - prefilled, 0.0),
                transfer_pages=len(dest.page_ids) if dest is not None and written and written.num_bytes else 0,
                prefill_chunks=req.prefill_chunks,
                chunk_s=chunk_durations(req.chunk_starts, prefilled) if req.admitted else (),
                prompt_logprobs=req.prompt_logprobs if ok else None,
            )
        )

    def abort(self, rid: str) -> PrefillResult | None:
        """Queued or prefilling: freed now. Transferring: answered now, freed when the WRITE ends
        (the agent may still be reading its pages). Its last chunk running: freed when its result
        arrives (process_batch_result)."""
        req = self.live.get(rid)
        if req is None or req.finished:
            return None
        req.finish_reason = FinishReason.ABORT
        parked = self.parked.pop(rid, None)
        if parked is not None or self.prefill.remove(rid) is not None:  # nothing reads its pages
            req.discard = req.pending
            self._finish(req)
        return PrefillResult(
            rid,
            req.room,
            None,
            None,
            len(req.prompt_ids),
            req.cached_tokens,
            error="aborted",
            error_code=ErrorCode.ABORTED,
        )

    def is_idle(self) -> bool:
        return (
            not (self.transfers or self.parked or self.destinations or self.live or self.prefill.has_work())
            and not self.sender.open_transfers()
            and self.kv.is_idle()
        )


def _expired(dest: Destination, now: float) -> str:
    return (
        f"the decode server's KV reservation at {dest.peer} ended {now - dest.expires:.2f}s ago: the "
        "prefill took longer than the decode server's --kv-transfer-timeout"
    )


def chunk_durations(starts: list[float], prefilled: float) -> tuple[float, ...]:
    """Each prefill batch's time: from its scheduling to the next one's, the last to the first token."""
    ends = [*starts[1:], prefilled]
    return tuple(max(end - start, 0.0) for start, end in zip(starts, ends))
