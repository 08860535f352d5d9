"""The decode server's engine: the engine core with the decode scheduler and a KV agent.

    engine = DecodeEngine(config, agent_name="decode-0")
    engine.add_decode_request(prompt_ids, params, room)
    ... engine.destinations: a KV destination per admitted request, for the prefill server ...
    for completions in event_loop_overlap_disagg_decode(engine): ...   (decode/loop.py)

The steps its loops call besides the shared ones (common/engine/core.py): `pop_preallocated`
admits queued requests (their pages are held and their destinations published) and
`pop_transferred` takes the KV notifications that arrived (those requests join the running batch)
and expires transfers past --kv-transfer-timeout.

With --tp-size N every rank's agent receives its own KV heads; the other ranks forward what their
agents receive, and a room completes once every rank's heads have landed (decode/arrivals.py) and,
with --kv-integrity-check, each rank has verified the pages that landed in its pool (decode/kv_checks.py).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Iterator, Sequence

from pdserve.common.config import EngineConfig
from pdserve.common.engine.core import EngineCore
from pdserve.common.engine.tp_messages import Notifs, Watch
from pdserve.common.kv_transfer import KVLayout
from pdserve.common.kv_transfer.base import KVSide
from pdserve.common.kv_transfer.server import ServerKV
from pdserve.common.serving import ipc
from pdserve.common.startup import StartupClock
from pdserve.common.types import Completion, FinishReason, Req, SamplingParams
from pdserve.decode.arrivals import KVArrivals, Refused
from pdserve.decode.kv_checks import KVChecks
from pdserve.decode.scheduler import DecodeScheduler
from pdserve.decode.timings import decode_timings, stamp_first_tokens

log = logging.getLogger(__name__)

_MAX_LOGGED_PEERS = 256  # senders of refused notifications are logged once each, up to this many


@dataclass
class KVDestination:
    """What the prefill server needs to WRITE a request's KV here (proto: KVDestination)."""

    rid: str
    room: int
    agent_name: str
    agent_metadata: bytes
    page_ids: list[int]  # for the prompt's positions from prefix_len on
    layout: KVLayout
    expires_unix_s: float  # this server frees the pages then: no WRITE may land later
    prefix_len: int = 0  # leading prompt tokens whose KV this server holds already (whole pages)


class DecodeEngine(EngineCore):
    def __init__(
        self,
        config: EngineConfig,
        agent_name: str,
        kv_transfer_timeout: float = 30.0,
        startup: StartupClock | None = None,
        kv_integrity_check: bool = False,
        warm_grammars: bool = False,
    ):
        startup = startup or StartupClock()
        self.kv: ServerKV | None = None  # the KV agents this engine owns (every rank's)
        # KV arrives over NIXL (only local prefills and retracted requests are prefilled here, eagerly):
        # no prefill graphs.
        super().__init__(
            config,
            startup,
            prefill_graphs=False,
            kv_side=KVSide.RECEIVER,
            kv_agent_name=agent_name,
            warm_grammars=warm_grammars,
        )
        with self.closed_on_error():
            self.kv = ServerKV.open(  # the ranks' agents meet
                agent_name, self.runner.kv_pool, self.tp_workers, verify_kv=kv_integrity_check
            )
            self.agent = self.kv.agent  # rank 0's
            self.arrivals = KVArrivals(self.kv.rank_layouts, self.vocab_size)
            scheduler = DecodeScheduler(
                self.config,
                self.runner.req_to_token_pool,
                self.runner.kv_pool,
                self.eos_token_ids,
                kv_transfer_timeout=kv_transfer_timeout,
                proposer=self.proposer,
            )
            # (each WRITE verified on the rank it landed on before its heads count: decode/kv_checks.py)
            self.checks = (
                KVChecks(self.agent, self.tp_workers, scheduler.received_pages) if kv_integrity_check else None
            )
        self.start(scheduler, startup)
        self.destinations: deque[KVDestination] = deque()
        self.streaming: dict[str, list] = {}  # rid -> [req, output tokens sent], with a channel
        self.rejected: dict[str, int] = {}  # reason -> notifications refused, not yet reported
        self._refused_peers: set[str] = set()  # senders already logged
        self._watching = False  # the other TP ranks were told transfers are open

    def close(self, kill: bool = False) -> None:
        super().close(kill)
        if self.kv is not None:
            self.kv.close()

    def add_decode_request(
        self, prompt_ids: Sequence[int], params: SamplingParams, room: int, rid: str | None = None
    ) -> str:
        """Queue a request whose KV a prefill server will write; ValueError when it cannot run here.
        Its text is built only where stop strings need it: the router detokenizes the stream."""
        return self._add(prompt_ids, params, room, rid).rid

    def add_local_request(self, prompt_ids: Sequence[int], params: SamplingParams, rid: str | None = None) -> Req:
        """Queue a request this server prefills itself (no KV transfer); ValueError when it cannot
        run here. Prompt logprobs are a prefill server's: asked for, the router sends it remote."""
        if params.prompt_logprobs is not None:
            raise ValueError(
                "prompt_logprobs are computed by prefill servers: this request cannot be prefilled locally"
            )
        req = self.make_req(prompt_ids, params, rid, detokenize=bool(params.stop))
        req.arrived = time.monotonic()
        self.scheduler.add_local_request(req)
        return req

    def _add(self, prompt_ids: Sequence[int], params: SamplingParams, room: int, rid: str | None):
        req = self.make_req(prompt_ids, params, rid, detokenize=bool(params.stop))
        req.room = room
        req.arrived = time.monotonic()
        self.scheduler.add_request(req)
        return req

    # ---- the decode steps of the loop ----------------------------------------------------------

    def pop_preallocated(self) -> None:
        """Admit queued requests into pages; publish each one's KV destination (one whose pages a
        store to the host tier still reads once no store does: DecodeScheduler.pop_settled)."""
        now = time.monotonic()
        for req in self.scheduler.pop_settled(now) + self.scheduler.pop_preallocated(now):
            req.granted = now
            expires_unix_s = time.time() + (req.deadline - now)  # wall clock: it crosses machines
            held = req.prefix_pages  # cached here: the prefill server writes the pages after them
            self.destinations.append(
                KVDestination(
                    req.rid,
                    req.room,
                    self.kv.name,
                    self.kv.encoded,
                    list(req.pages[held:]),
                    self.kv.layout,
                    expires_unix_s,
                    held * self.kv.layout.page_size,
                )
            )
        self._watch()

    def pop_transferred(self) -> None:
        """Requests whose KV landed (on every TP rank) join the running batch; those past their
        deadline fail.

        Only a notification that matches a destination this server granted — its room, page count,
        heads and byte count — is acted on: anyone who reaches a UCX port can send one. Any other
        is counted by reason, its sender logged once, and changes no request."""
        scheduler = self.scheduler
        waiting = scheduler.transferring.__contains__
        for rank, peer, message in self._notifications():
            try:
                landing = self.arrivals.accept(rank, message, scheduler.granted_pages, waiting)
            except Refused as refused:
                self._refuse(peer, refused.reason, refused.detail)
                continue
            if landing is None:
                continue
            if self.checks is None:
                self._land(landing)
            else:
                self.checks.submit(landing, peer)  # (landed, unverified: its heads count once it passes)
        if self.checks is not None:
            for landing, peer, why in self.checks.done(waiting):
                if why is None:
                    self._land(landing)
                else:
                    self._corrupted(landing.room, peer, why)
        self.outputs += scheduler.expire_transfers(time.monotonic())
        scheduler.join_loaded()
        if self.arrivals.partial:
            self.arrivals.forget(waiting)
        if self.checks is not None and self.checks.asked:
            self.checks.forget(waiting)
        self._watch()

    def _land(self, landing) -> None:
        landed = self.arrivals.land(landing)
        if landed is not None:
            completion = self.scheduler.on_kv_arrived(*landed)
            if completion is not None:
                self.outputs.append(completion)

    def _corrupted(self, room: int, peer: str, why: str) -> None:
        """A WRITE for `room` landed pages that are not its sender's: the request fails, undecoded."""
        self._refuse(peer, "checksum", why)
        why = f"KV integrity check failed (room {room}): {why}; its pages were not decoded"
        failed = self.scheduler.fail_transfer(room, why, time.monotonic())
        if failed is not None:
            self.outputs.append(failed)

    def _notifications(self) -> list[tuple[int, str, bytes]]:
        """(receiving rank, sending agent, notification): rank 0's agent's, then the other ranks'."""
        received = [(0, peer, message) for peer, message in self.agent.get_notifs()]
        if self.tp_workers is not None:
            for report in self.tp_workers.take(Notifs):
                received += [(report.rank, peer, message) for peer, message in report.notifs]
        return received

    def _watch(self) -> None:
        """Tell the other ranks whether transfers are open: they poll their agents meanwhile (a
        DRAM agent progresses only when polled)."""
        open_now = bool(self.scheduler.transferring)
        if self.tp_workers is not None and open_now != self._watching:
            self._watching = open_now
            self.tp_workers.broadcast(Watch(open_now))

    def _refuse(self, peer: str, reason: str, detail: str) -> None:
        self.rejected[reason] = self.rejected.get(reason, 0) + 1
        if peer not in self._refused_peers and len(self._refused_peers) < _MAX_LOGGED_PEERS:
            self._refused_peers.add(peer)
            log.warning(
                "refused a KV transfer notification from agent %r (%s: %s); further ones from it are only "
                "counted (pdserve_kv_rejected_transfers_total)",
                peer,
                reason,
                detail,
            )

    def event_loop(self) -> Iterator[list[Completion]]:
        from pdserve.decode.loop import event_loop_normal_disagg_decode, event_loop_overlap_disagg_decode

        overlap = not self.config.disable_overlap_schedule
        return event_loop_overlap_disagg_decode(self) if overlap else event_loop_normal_disagg_decode(self)

    # ---- the server's messages -----------------------------------------------------------------

    def process_input_requests(self, msgs: list) -> None:
        for msg in msgs:
            if isinstance(msg, ipc.NewRequest):
                try:
                    params = ipc.sampling_params(msg.params)
                    if msg.local:
                        req = self.add_local_request(msg.prompt_ids, params, msg.rid)
                    else:
                        req = self._add(msg.prompt_ids, params, msg.room, msg.rid)
                except ValueError as e:
                    self.channel.send(ipc.Rejected(msg.rid, str(e)))
                    continue
                self.streaming[msg.rid] = [req, 0]
            elif isinstance(msg, ipc.Abort):
                completion = self.abort(msg.rid)
                if completion is not None:
                    self.outputs.append(completion)
            elif isinstance(msg, ipc.SetDestination):
                self.channel.send(ipc.Rejected(msg.rid, "a decode server takes no KV destinations"))

    def send_outputs(self) -> list[Completion]:
        """Destinations, the requests' new tokens (one message per step; a request's every
        --stream-interval tokens), then the finished (with what they had not sent)."""
        done = self.take_outputs()
        if self.channel is None:
            return done
        send = self.channel.send
        while self.destinations:
            d = self.destinations.popleft()
            send(ipc.Destination(d.rid, d.room, d.page_ids, d.expires_unix_s, d.prefix_len))
        chunks, interval, s, now = [], self.config.stream_interval, self.scheduler, time.monotonic()
        # NOTE: only these can hold unsent tokens (waiting: retracted ones; the finished, whose last
        # tokens go with their logprobs here, before their Finished); a burst queues thousands more
        # for their KV, which a walk of self.streaming visited every step: 11% of the loop.
        ended = [self.streaming[c.rid][0] for c in done if c.rid in self.streaming]
        for req in itertools.chain(s.running, s.ready, s.landed, s.waiting, ended):
            entry = self.streaming.get(req.rid)
            if entry is None:
                continue
            rid, sent = req.rid, entry[1]
            new = len(req.output_ids) - sent
            if new > 0 and sent < 2:  # (its first tokens only: a stamp or two, not a check every step)
                stamp_first_tokens(req, now)
            if new > 0 and (new >= interval or sent == 0):  # the first token at once; the rest on finish
                lps = [(lp.token_id, lp.logprob, lp.top) for lp in req.output_logprobs[sent:]]
                chunks.append(ipc.Tokens(rid, sent, req.output_ids[sent:], lps))
                entry[1] = len(req.output_ids)
        if chunks:
            send(ipc.StepTokens(chunks))
        if self.rejected:
            send(ipc.TransfersRejected(self.rejected))
            self.rejected = {}
        for c in done:
            entry = self.streaming.pop(c.rid, None)
            if entry is not None and len(c.output_ids) > entry[1]:
                send(ipc.Tokens(c.rid, entry[1], c.output_ids[entry[1] :]))
            ended = entry is not None and c.error is None and c.finish_reason is not FinishReason.ABORT
            timings = decode_timings(entry[0], now) if ended else None
            send(
                ipc.Finished(
                    c.rid,
                    c.finish_reason.value,
                    len(c.prompt_ids),
                    len(c.output_ids),
                    c.cached_tokens,
                    matched_token=c.matched_stop if isinstance(c.matched_stop, int) else None,
                    matched_text=c.matched_stop if isinstance(c.matched_stop, str) else None,
                    error=c.error,
                    error_code=c.error_code,
                    timings=timings,
                )
            )
        return done

    def load(self) -> ipc.LoadReport:
        s = self.scheduler
        return ipc.LoadReport(
            running=len(s.running),
            waiting=len(s.waiting) + len(s.prealloc) + len(s.transferring) + len(s.landed) + len(s.ready),
            kv_used_tokens=s.kv_used_tokens(),
            kv_total_tokens=self.runner.kv_pool.capacity_tokens,
            inflight_transfers=len(s.transferring),
            host_tier=s.kv.host_tier_report(),
            speculation=s.speculation.report() if s.speculation is not None else {},
        )

    def ready(self) -> ipc.Ready:
        from pdserve.common.serving.frontend import ready_message

        return ready_message(self)
