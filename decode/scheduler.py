"""The decode role's scheduler: KV arrives over the network instead of from a prefill forward.

Queues, in the order a request passes through them (docs/architecture.md, "The disaggregated request"):
    prealloc      waiting for a row and pages for its prompt (+ reserved decode tokens)
    transferring  pages handed out as a KV destination; waiting, under a deadline, for the
                  prefill server's WRITE and its notification (keyed by the request's room).
                  A request aborted or past its deadline stays here, answered but holding
                  its pages, until the notification, or KV_WRITE_GRACE_S after the deadline,
                  says no WRITE can land in them any more (prefill servers start none after
                  the deadline, which the destination carries, and give up on one at half
                  the grace). With a host tier, a destination whose pages an eviction freed
                  while a store to host memory still reads them is `held` (not published)
                  until those stores complete: the prefill server's WRITE is ordered by no
                  CUDA stream here, and would corrupt the host copy (`pop_settled`).
    landed        the KV and the first token arrived, but the cached prefix it pinned is still
                  being copied back from the host tier (--host-kv-cache-gb): it waits, others run
    ready         the KV and the first token arrived while --max-running-requests were running:
                  it joins the batch as soon as one of them ends
    running       the KV and the first token arrived: it decodes like any colocated request,
                  joining the batch without a forward pass of its own

Pages are granted to up to twice --max-running-requests requests (the rows are twice as many,
ModelRunner), memory permitting, so that the next requests' KV is already here when running ones
end: granting only as slots free made every finished request wait a round trip through the router
and the prefill server before its slot decoded again (SGLang's decode server pre-allocates the same
way). Every request holding pages keeps its decode reservation, as in colocated admission.
    waiting       local prefills (GenerateRequest.local_prefill: the router chose not to
                  disaggregate it), and requests retracted under KV pressure: both prefilled
                  here, in chunks, each chunk followed by a decode step of the running requests
                  (so they wait at most one chunk for their next token)

The decode server keeps a prefix cache (unless --disable-radix-cache): a finished request's KV,
transferred or computed here, is cached like a colocated one's, and a local prefill (or a retracted
request's) starts from its longest cached prefix. A transfer fills pages of its own after
the longest prefix this server's cache holds, which the request pins until it ends (the prefill server
writes only those pages: a multi-turn conversation's next turn sends its new tokens, not its whole
history; --disable-prefix-aware-transfers sends whole prompts). Host only, like the colocated
scheduler it extends: a preallocated request's row is queued as a RowWrite, and the batch builder
writes it on the schedule stream before the request's first step.
"""

from __future__ import annotations

import time
from collections import deque

from pdserve.common.config import EngineConfig
from pdserve.common.engine.kv_pool import PagedKVPool, ReqToTokenPool
from pdserve.common.errors import ErrorCode
from pdserve.common.scheduling.batch import ForwardMode, ScheduleBatch
from pdserve.common.scheduling.output_processor import append_token, finalize
from pdserve.common.scheduling.pages import pages_for
from pdserve.common.scheduling.scheduler import Scheduler
from pdserve.common.types import KV_WRITE_GRACE_S, Completion, FinishReason, Req, TokenLogprob


class DecodeScheduler(Scheduler):
    def __init__(
        self,
        config: EngineConfig,
        req_to_token_pool: ReqToTokenPool,
        kv_pool: PagedKVPool,
        eos_token_ids: tuple[int, ...],
        kv_transfer_timeout: float,
        proposer=None,
    ):
        # (prefix cache: unless --disable-radix-cache; `proposer`: speculative decoding's, or None)
        super().__init__(config, req_to_token_pool, kv_pool, eos_token_ids, proposer=proposer)
        self.kv_transfer_timeout = kv_transfer_timeout
        self.prealloc: deque[Req] = deque()
        self._prealloc_rooms: set[int] = set()  # (a burst queues thousands: no scan per request)
        self.transferring: dict[int, Req] = {}  # room -> request
        # room -> the stores its pages wait for: transferring, its destination not yet published.
        self.held: dict[int, list] = {}
        self.landed: list[Req] = []  # arrived; their pinned prefix still loading from host memory
        self.ready: deque[Req] = deque()  # arrived while the running batch was full
        self.max_granted = 2 * config.max_running_requests  # requests holding pages: the rows there are
        # Rooms whose KV arrived, with their granted page counts, until no WRITE for them can land
        # (a retried prefill's late copy is still a granted one): room -> pages, and (forget at, room).
        self.served: dict[int, int] = {}
        self._served_order: deque[tuple[float, int]] = deque()
        self._after_prefill = False  # the last batch was a prefill (chunk)
        # Prompt tokens whose KV a transfer did not carry: this server's prefix cache held them.
        self.transfer_stats = {"prefix_hit_tokens": 0}

    @property
    def stats(self) -> dict[str, int]:
        return super().stats | {"transfer_" + k: v for k, v in self.transfer_stats.items()}

    def add_local_request(self, req: Req) -> None:
        """A request this server prefills itself: it waits with the colocated scheduler's queue."""
        super().add_request(req)

    def get_next_batch_to_run(self) -> ScheduleBatch | None:
        # NOTE local prefills alternate with decode steps: after a prefill chunk, the running
        # requests take a step before the next chunk, so no stream stalls for a whole prompt.
        self._take_ready()
        if self._after_prefill and self.decode.running:
            self._after_prefill = False
            batch = self.decode_step()
            if batch is not None:
                return batch
        batch = super().get_next_batch_to_run()
        self._after_prefill = batch is not None and batch.mode is ForwardMode.EXTEND
        return batch

    def add_request(self, req: Req) -> None:
        self.check_request(req.prompt_ids, req.params)
        if req.room in self.transferring or req.room in self._prealloc_rooms:
            raise ValueError(f"room {req.room} is already in use")
        self.prealloc.append(req)
        self._prealloc_rooms.add(req.room)

    def has_work(self) -> bool:
        return bool(self.prealloc or self.transferring or self.landed or self.ready) or super().has_work()

    def pop_preallocated(self, now: float) -> list[Req]:
        """Give queued requests a row and the pages for their prompt, oldest first; returns those
        whose destination may be published now (the others are `held`: `pop_settled`).

        Admission keeps, as for colocated requests, room for every admitted request's next
        num_reserved_decode_tokens tokens; a request that does not fit blocks those behind it.
        """
        if not self.prealloc:  # the common case, every loop iteration: no O(running) scan
            return []
        admitted = []
        num_holders = len(self.running) + len(self.transferring) + len(self.landed) + len(self.ready)
        if num_holders + 1 > self.max_granted or self.kv.rows_available() == 0:
            return []  # full, as it is every iteration of a burst: none would be admitted, nothing scanned
        holders = self.running + list(self.transferring.values()) + self.landed + list(self.ready)
        available = self.kv.available_pages() - self.kv.reserved_pages(holders)
        match = not self.config.disable_prefix_aware_transfers
        while self.prealloc:
            req = self.prealloc[0]
            if len(holders) + len(admitted) + 1 > self.max_granted:
                break
            if self.kv.rows_available() == 0:
                break
            evictable_before = self.kv.available_pages()
            prefix_pages, node = self.kv.match_for_transfer(req) if match else ([], None)
            available -= evictable_before - self.kv.available_pages()  # locked: no longer evictable
            need = self.kv.reserve_pages(req) - len(prefix_pages)
            if need > available:
                self.kv.unlock(node, req)  # (waits for a copy just started into it: rare)
                break
            self._prealloc_rooms.discard(self.prealloc.popleft().room)
            # Its KV comes from the prefill server: the pages after the prefix this server holds.
            self.kv.admit_for_transfer(req, len(req.prompt_ids), prefix_pages, node)
            self.transfer_stats["prefix_hit_tokens"] += len(prefix_pages) * self.kv.page_size
            req.deadline = now + self.kv_transfer_timeout
            self.transferring[req.room] = req
            unsettled = self.kv.unsettled_events(req.pages[req.prefix_pages :])
            if unsettled:  # (pages an eviction just freed: a store to host memory still reads them)
                self.held[req.room] = unsettled
            admitted.append(req)
            available -= need
        return [r for r in admitted if r.room not in self.held]

    def pop_settled(self, now: float) -> list[Req]:
        """Held requests whose pages no store reads any more: their destination may be published
        now, and their deadline starts now (the prefill server gets its whole timeout). Never waits."""
        if not self.held:
            return []
        settled = []
        for room, events in list(self.held.items()):
            events = [e for e in events if not e.query()]
            if events:
                self.held[room] = events
                continue
            del self.held[room]
            req = self.transferring[room]
            req.deadline = now + self.kv_transfer_timeout
            settled.append(req)
        return settled

    def granted_pages(self, room: int) -> int | None:
        """Pages this server granted for `room` (its destination), None if it granted none
        (or so long ago that no WRITE for it may land any more)."""
        req = self.transferring.get(room)
        if req is not None:
            return None if room in self.held else self.pages_to_receive(req)  # (held: not granted yet)
        return self.served.get(room)

    def pages_to_receive(self, req: Req) -> int:
        """The pages of its prompt's KV the prefill server writes: those after the cached prefix."""
        return pages_for(len(req.prompt_ids), self.kv.page_size) - req.prefix_pages

    def on_kv_arrived(self, room: int, first_token: int, logprob: TokenLogprob | None) -> Completion | None:
        """The prefill's WRITE for `room` landed: the request joins running with its first token.

        A notification for a room not waiting (late, duplicate, or from an abandoned attempt after
        a retry) is ignored: the first completed transfer for a room wins.
        """
        req = self.transferring.pop(room, None)
        if req is None:
            return None
        req.kv_landed = time.monotonic()
        self.served[room] = self.pages_to_receive(req)
        self._served_order.append((req.deadline + KV_WRITE_GRACE_S, room))
        if req.finished:  # aborted while its WRITE was in flight: now the pages are quiet
            self.kv.free(req)
            return None
        append_token(req, first_token, logprob, self.eos_token_ids, self.config.context_length)
        if req.finished:
            self.kv.free(req)
            return finalize(req)
        if not self.kv.kv_load_done(req):
            self.landed.append(req)  # (join_loaded: once its prefix is back on the device)
            return None
        self.ready.append(req)
        self._take_ready()
        return None

    def _take_ready(self) -> None:
        """Arrived requests join the running batch, oldest first, while it has room."""
        while self.ready and len(self.running) < self.config.max_running_requests:
            req = self.ready.popleft()
            req.joined = time.monotonic()
            self.running.append(req)

    def join_loaded(self) -> None:
        """Landed requests whose prefix is back from the host tier join the running batch."""
        if self.landed:
            ready = [r for r in self.landed if self.kv.kv_load_done(r)]
            self.landed = [r for r in self.landed if r.kv_load is not None]
            self.ready.extend(ready)
            self._take_ready()

    def expire_transfers(self, now: float) -> list[Completion]:
        """Requests whose KV did not arrive in time: answered with an error at their deadline,
        their pages freed KV_WRITE_GRACE_S later (a WRITE started just before the deadline may
        still be landing)."""
        while self._served_order and self._served_order[0][0] < now:  # (roughly in order: soon enough)
            self.served.pop(self._served_order.popleft()[1], None)
        timed_out = []
        for req in [req for req in self.transferring.values() if now > req.deadline]:
            if not req.finished:  # (an aborted one was already answered)
                req.finish_reason = FinishReason.ABORT
                req.error = f"KV transfer timed out after {self.kv_transfer_timeout:g}s (room {req.room})"
                req.error_code = ErrorCode.KV_TRANSFER_TIMEOUT
                timed_out.append(finalize(req))
            if now > req.deadline + KV_WRITE_GRACE_S or self.held.pop(req.room, None) is not None:
                del self.transferring[req.room]  # (held: its destination never left, no WRITE can land)
                self.kv.free(req)
        return timed_out

    def fail_transfer(self, room: int, why: str, now: float) -> Completion | None:
        """A WRITE for `room` landed pages that are not the ones the sender computed (integrity.py):
        the request fails now with KV_TRANSFER_FAILED and is never decoded; its pages are freed as a
        timed-out transfer's are, KV_WRITE_GRACE_S later (another WRITE of the room may still land)."""
        req = self.transferring.get(room)
        if req is None or req.finished:
            return None
        req.finish_reason = FinishReason.ABORT
        req.error, req.error_code = why, ErrorCode.KV_TRANSFER_FAILED
        req.deadline = min(req.deadline, now)  # (expire_transfers frees it after the grace)
        return finalize(req)

    def received_pages(self, room: int) -> list[int]:
        """The pages a WRITE for `room` (still waiting) lands in: its prompt's pages after the
        cached prefix, in the order the destination listed them."""
        req = self.transferring[room]
        return list(req.pages[req.prefix_pages : req.prefix_pages + self.pages_to_receive(req)])

    def abort(self, rid: str) -> Completion | None:
        for queue in (self.landed, self.ready):
            req = next((r for r in queue if r.rid == rid), None)
            if req is not None:
                queue.remove(req)
                req.finish_reason = FinishReason.ABORT
                self.kv.free(req)  # (waits for its copy from the host tier)
                return finalize(req)
        for req in self.prealloc:
            if req.rid == rid:
                self.prealloc.remove(req)
                self._prealloc_rooms.discard(req.room)
                req.finish_reason = FinishReason.ABORT
                return finalize(req)
        for req in self.transferring.values():
            if req.rid == rid and not req.finished:
                # NOTE: the prefill server may still WRITE into these pages: they stay with the
                # request until its notification arrives or its deadline and grace pass, so a
                # late WRITE can never land in a new owner's KV. The client is answered now.
                req.finish_reason = FinishReason.ABORT
                if self.held.pop(req.room, None) is not None:  # never published: no WRITE can land
                    del self.transferring[req.room]
                    self.kv.free(req)
                return finalize(req)
        return super().abort(rid)

    def is_idle(self) -> bool:
        return not (self.prealloc or self.transferring or self.landed or self.ready) and super().is_idle()
