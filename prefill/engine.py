"""The prefill server's engine: the engine core with the prefill scheduler and a KV agent.

    engine = PrefillEngine(config, agent_name="prefill-0")
    engine.add_prefill_request(prompt_ids, params, room, decode_metadata, page_ids)
    engine.set_destination(rid, decode_metadata, page_ids)    # when the request came without one
    for results in event_loop_overlap_disagg_prefill(engine): ...   (prefill/loop.py; PrefillResults)

The step its loops call besides the shared ones (common/engine/core.py): `process_inflight_queue`
polls the KV WRITEs in flight, never blocking, and reports the requests whose transfer ended.

With --tp-size N every rank holds its KV heads and WRITEs them itself: rank 0 (this process) plans
and orders the WRITEs, and answers a request only once every rank's has ended
(common/kv_transfer/sender.py).
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Iterator, Sequence

from pdserve.common.config import EngineConfig
from pdserve.common.engine.core import EngineCore
from pdserve.common.kv_transfer.base import KVSide
from pdserve.common.kv_transfer.sender import KVSender
from pdserve.common.kv_transfer.server import ServerKV
from pdserve.common.serving import ipc
from pdserve.common.startup import StartupClock
from pdserve.common.types import SamplingParams
from pdserve.prefill.scheduler import Destination, PrefillResult, PrefillScheduler


class PrefillEngine(EngineCore):
    def __init__(
        self,
        config: EngineConfig,
        agent_name: str,
        kv_transfer_timeout: float = 30.0,
        startup: StartupClock | None = None,
        kv_transfer_path: str = "auto",
        warm_grammars: bool = False,
    ):
        startup = startup or StartupClock()
        self.kv: ServerKV | None = None  # the KV agents this engine owns (every rank's)
        # A prefill server never runs a decode step: one decode graph (batch 1) only gives the prefill
        # graphs their memory pool; capturing every batch size cost 1.3-1.7 s of its start on an H200.
        config = dataclasses.replace(config, cuda_graph_max_bs=1)
        super().__init__(
            config,
            startup,
            kv_side=KVSide.SENDER,
            kv_agent_name=agent_name,
            kv_transfer_path=kv_transfer_path,
            warm_grammars=warm_grammars,
        )
        with self.closed_on_error():
            # (the ranks' agents meet here)
            self.kv = ServerKV.open(agent_name, self.runner.kv_pool, self.tp_workers, kv_transfer_path)
            self.agent = self.kv.agent  # rank 0's
            self.sender = KVSender(self.kv, self.tp_workers)
            scheduler = PrefillScheduler(
                self.config,
                self.runner.req_to_token_pool,
                self.runner.kv_pool,
                sender=self.sender,
                kv_transfer_timeout=kv_transfer_timeout,
            )
        self.start(scheduler, startup)

    def close(self, kill: bool = False) -> None:
        super().close(kill)
        if self.kv is not None:
            self.kv.close()

    def event_loop(self) -> Iterator[list[PrefillResult]]:
        from pdserve.prefill.loop import event_loop_normal_disagg_prefill, event_loop_overlap_disagg_prefill

        overlap = not self.config.disable_overlap_schedule
        return event_loop_overlap_disagg_prefill(self) if overlap else event_loop_normal_disagg_prefill(self)

    def add_prefill_request(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        room: int,
        decode_metadata: bytes,
        page_ids: list[int],
        rid: str | None = None,
        expires_unix_s: float = 0.0,
        prefix_len: int = 0,
    ) -> str:
        """Queue a prompt whose KV goes to the decode server described by `decode_metadata`
        (empty: not known yet, `set_destination` follows; the prefill starts anyway), into pages
        it holds until `expires_unix_s` (0: no limit), for the prompt's positions from `prefix_len`
        on (the decode server holds the KV before it).

        The peer's metadata is cached by the agent (adding the same peer again is free); an
        incompatible KV layout raises ValueError, as does a request that can never run here.
        """
        req = self.make_req(prompt_ids, params, rid, detokenize=False)  # it samples one token, sends no text
        req.room = room
        req.arrived = time.monotonic()
        destination = None
        if decode_metadata:
            destination = Destination(
                self.sender.add_peer(decode_metadata), list(page_ids), _expiry(expires_unix_s), prefix_len
            )
        self.scheduler.add_prefill_request(req, destination)
        return req.rid

    def set_destination(
        self, rid: str, decode_metadata: bytes, page_ids: list[int], expires_unix_s: float = 0.0, prefix_len: int = 0
    ) -> None:
        """The destination of a request queued without one; ValueError for a bad one."""
        peer = self.sender.add_peer(decode_metadata)
        self.scheduler.set_destination(
            rid, Destination(peer, list(page_ids), _expiry(expires_unix_s), prefix_len), time.monotonic()
        )

    def process_inflight_queue(self) -> None:
        """The transfers that ended (done, failed or late), and the parked requests whose
        destination never came, become results."""
        self.outputs += self.scheduler.poll_transfers(time.monotonic())

    # ---- the server's messages -----------------------------------------------------------------

    def process_input_requests(self, msgs: list) -> None:
        for msg in msgs:
            if isinstance(msg, ipc.NewRequest):
                try:
                    self.add_prefill_request(
                        msg.prompt_ids,
                        ipc.sampling_params(msg.params),
                        msg.room,
                        msg.peer_metadata,
                        msg.page_ids,
                        rid=msg.rid,
                        expires_unix_s=msg.expires_unix_s,
                        prefix_len=msg.prefix_len,
                    )
                except ValueError as e:
                    self.channel.send(ipc.Rejected(msg.rid, str(e)))
            elif isinstance(msg, ipc.SetDestination):
                try:
                    self.set_destination(msg.rid, msg.peer_metadata, msg.page_ids, msg.expires_unix_s, msg.prefix_len)
                except ValueError as e:  # the request cannot be served: dropped, and answered as refused
                    self.scheduler.abort(msg.rid)
                    self.channel.send(ipc.Rejected(msg.rid, str(e)))
            elif isinstance(msg, ipc.Abort):
                result = self.scheduler.abort(msg.rid)
                if result is not None:
                    self.outputs.append(result)

    def send_outputs(self) -> list[PrefillResult]:
        done = self.take_outputs()
        if self.channel is None:
            return done
        for r in done:
            lp = r.first_logprob
            self.channel.send(
                ipc.PrefillDone(
                    r.rid,
                    r.first_token,
                    (lp.token_id, lp.logprob, lp.top) if lp is not None else None,
                    r.prompt_tokens,
                    r.cached_tokens,
                    queue_s=r.queue_s,
                    prefill_s=r.prefill_s,
                    destination_wait_s=r.destination_wait_s,
                    transfer_pages=r.transfer_pages,
                    prefill_chunks=r.prefill_chunks,
                    chunk_s=r.chunk_s,
                    transfer_path=r.transfer_path,
                    transfer_s=r.transfer_s,
                    transfer_bytes=r.transfer_bytes,
                    error=r.error,
                    error_code=r.error_code,
                    prompt_logprobs=None
                    if r.prompt_logprobs is None
                    else [(p.token_id, p.logprob, p.top, p.rank) for p in r.prompt_logprobs[1:]],
                )
            )
        return done

    def load(self) -> ipc.LoadReport:
        s = self.scheduler
        return ipc.LoadReport(
            running=len(s.transfers) + len(s.parked) + (1 if s.prefill.chunked_req else 0),
            waiting=len(s.prefill.waiting),
            kv_used_tokens=s.kv_used_tokens(),
            kv_total_tokens=self.runner.kv_pool.capacity_tokens,
            inflight_transfers=len(s.transfers),
            host_tier=s.kv.host_tier_report(),
        )

    def ready(self) -> ipc.Ready:
        from pdserve.common.serving.frontend import ready_message

        return ready_message(self)


def _expiry(expires_unix_s: float) -> float:
    """A destination's wall-clock expiry on this process's monotonic clock (inf: none)."""
    if not expires_unix_s:
        return math.inf
    return time.monotonic() + (expires_unix_s - time.time())
