"""The prefill server's engine: the colocated engine with the prefill scheduler and a KV agent.

    engine = PrefillEngine(config, agent_name="prefill-0")
    engine.add_prefill_request(prompt_ids, params, room, decode_metadata, page_ids)
    engine.set_destination(rid, decode_metadata, page_ids)    # when the request came without one
    for result in engine.event_loop_overlap_disagg_prefill(): ...   # a PrefillResult per request

The loops are the colocated ones (LoopState) with one addition at the top of every iteration:
poll the KV transfers in flight, never blocking.
"""

from __future__ import annotations

import math
import time
from typing import Iterator, Sequence

from pdserve.common.config import EngineConfig
from pdserve.common.engine import Engine, LoopState
from pdserve.common.kv_transfer.nixl_agent import NixlKVAgent
from pdserve.common.types import SamplingParams
from pdserve.prefill.scheduler import Destination, PrefillResult, PrefillScheduler


class PrefillEngine(Engine):
    def __init__(self, config: EngineConfig, agent_name: str, kv_transfer_timeout: float = 30.0):
        self._agent_name, self._kv_transfer_timeout = agent_name, kv_transfer_timeout
        super().__init__(config)

    def make_scheduler(self) -> PrefillScheduler:
        self.agent = NixlKVAgent(self._agent_name, self.runner.kv_pool)
        return PrefillScheduler(
            self.config,
            self.runner.req_to_token_pool,
            self.runner.kv_pool,
            self.eos_token_ids,
            agent=self.agent,
            kv_transfer_timeout=self._kv_transfer_timeout,
        )

    def add_prefill_request(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        room: int,
        decode_metadata: bytes,
        page_ids: list[int],
        rid: str | None = None,
        expires_unix_s: float = 0.0,
    ) -> str:
        """Queue a prompt whose KV goes to the decode server described by `decode_metadata`
        (empty: not known yet, `set_destination` follows; the prefill starts anyway), into pages
        it holds until `expires_unix_s` (0: no limit).

        The peer's metadata is cached by the agent (adding the same peer again is free); an
        incompatible KV layout raises ValueError, as does a request that can never run here.
        """
        req = self.make_req(prompt_ids, params, rid)
        req.room = room
        destination = None
        if decode_metadata:
            destination = Destination(self.agent.add_peer(decode_metadata), list(page_ids), _expiry(expires_unix_s))
        self.scheduler.add_prefill_request(req, destination)
        return req.rid

    def set_destination(self, rid: str, decode_metadata: bytes, page_ids: list[int], expires_unix_s: float = 0.0) -> None:
        """The destination of a request queued without one; ValueError for a bad one."""
        peer = self.agent.add_peer(decode_metadata)
        self.scheduler.set_destination(rid, Destination(peer, list(page_ids), _expiry(expires_unix_s)), time.monotonic())

    def poll(self) -> list[PrefillResult]:
        return self.scheduler.poll_transfers(time.monotonic())

    def event_loop_overlap_disagg_prefill(self) -> Iterator[PrefillResult]:
        """Overlapped loop until every queued prompt's transfer has ended."""
        yield from self._run(LoopState(self, overlap=True, poll=self.poll))

    def event_loop_normal_disagg_prefill(self) -> Iterator[PrefillResult]:
        """The serial twin (--disable-overlap-schedule)."""
        yield from self._run(LoopState(self, overlap=False, poll=self.poll))

    def loop_state(self) -> LoopState:
        """One loop of the configured kind, for a server that interleaves iterations with I/O."""
        return LoopState(self, overlap=not self.config.disable_overlap_schedule, poll=self.poll)

    def _run(self, loop: LoopState) -> Iterator[PrefillResult]:
        while loop.busy():
            yield from loop.step()


def _expiry(expires_unix_s: float) -> float:
    """A destination's wall-clock expiry on this process's monotonic clock (inf: none)."""
    if not expires_unix_s:
        return math.inf
    return time.monotonic() + (expires_unix_s - time.time())
