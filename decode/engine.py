"""The decode server's engine: the colocated engine with the decode scheduler and a KV agent.

    engine = DecodeEngine(config, agent_name="decode-0")
    engine.add_decode_request(prompt_ids, params, room)
    ... engine.destinations: a KV destination per admitted request, for the prefill server ...
    for completion in engine.event_loop_overlap_disagg_decode(): ...

Every iteration first polls, never blocking: admit preallocations (their destinations are
published), take the KV notifications that arrived (those requests join the running batch), and
expire transfers past --kv-transfer-timeout.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Iterator, Sequence

from pdserve.common.config import EngineConfig
from pdserve.common.engine import Engine, LoopState
from pdserve.common.kv_transfer import KVLayout, decode_notif
from pdserve.common.kv_transfer.nixl_agent import NixlKVAgent
from pdserve.common.types import Completion, SamplingParams, TokenLogprob
from pdserve.decode.scheduler import DecodeScheduler


@dataclass
class KVDestination:
    """What the prefill server needs to WRITE a request's KV here (proto: KVDestination)."""

    rid: str
    room: int
    agent_name: str
    agent_metadata: bytes
    page_ids: list[int]
    layout: KVLayout
    expires_unix_s: float  # this server frees the pages then: no WRITE may land later


class DecodeEngine(Engine):
    runs_prefill = False
    def __init__(self, config: EngineConfig, agent_name: str, kv_transfer_timeout: float = 30.0):
        self._agent_name, self._kv_transfer_timeout = agent_name, kv_transfer_timeout
        super().__init__(config)
        self.destinations: deque[KVDestination] = deque()
        self.ignored_notifs = 0

    def make_scheduler(self) -> DecodeScheduler:
        self.agent = NixlKVAgent(self._agent_name, self.runner.kv_pool)
        return DecodeScheduler(
            self.config,
            self.runner.req_to_token_pool,
            self.runner.kv_pool,
            self.eos_token_ids,
            kv_transfer_timeout=self._kv_transfer_timeout,
        )

    def add_decode_request(self, prompt_ids: Sequence[int], params: SamplingParams, room: int, rid: str | None = None) -> str:
        req = self.make_req(prompt_ids, params, rid)
        req.room = room
        self.scheduler.add_request(req)
        return req.rid

    def poll(self) -> list[Completion]:
        now = time.monotonic()
        metadata = None
        for req in self.scheduler.pop_preallocated(now):
            metadata = metadata or self.agent.metadata()
            expires_unix_s = time.time() + (req.deadline - now)  # wall clock: it crosses machines
            self.destinations.append(KVDestination(
                req.rid, req.room, self.agent.name, metadata, list(req.pages), self.agent.layout, expires_unix_s))
        done = []
        for _peer, message in self.agent.get_notifs():
            try:
                notif = decode_notif(message)
            except ValueError:
                self.ignored_notifs += 1  # not ours: never let a peer's bytes crash the loop
                continue
            lp = notif.get("logprobs")
            logprob = TokenLogprob(lp["token_id"], lp["logprob"], [tuple(t) for t in lp["top"]]) if lp else None
            completion = self.scheduler.on_kv_arrived(notif["room"], notif["first_token"], logprob)
            if completion is not None:
                done.append(completion)
        return done + self.scheduler.expire_transfers(now)

    def event_loop_overlap_disagg_decode(self) -> Iterator[Completion]:
        """Overlapped loop until nothing is queued, transferring or running."""
        yield from self._run(LoopState(self, overlap=True, poll=self.poll))

    def event_loop_normal_disagg_decode(self) -> Iterator[Completion]:
        """The serial twin (--disable-overlap-schedule)."""
        yield from self._run(LoopState(self, overlap=False, poll=self.poll))

    def loop_state(self) -> LoopState:
        return LoopState(self, overlap=not self.config.disable_overlap_schedule, poll=self.poll)

    def _run(self, loop: LoopState) -> Iterator[Completion]:
        while loop.busy():
            yield from loop.step()
