"""What TP ranks 1..N-1 of a prefill or decode server do for KV transfers, between the forwards
rank 0 sends them (common/engine/tp_worker.py `follow`). Each rank has its own agent over its own
pool (its KV heads); rank 0 decides everything and these carry it out.

    SenderDuty      (the sending server's ranks) WRITE their heads' pages as rank 0 orders
                    (WriteKV), once the forward that computed them has completed on this rank's
                    device; report each WRITE's end to rank 0
    ReceiverDuty    (the receiving server's ranks) hand every notification their agent receives
                    to rank 0, which alone knows the grants and when a room is complete; sum the
                    pages a WRITE landed in here when rank 0 asks (CheckKV: decode/kv_checks.py)

`poll()` never blocks; `active` says whether the rank should poll often (a DRAM agent has no
progress thread: UCX moves only when it is polled).
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from pdserve.common.engine.tp_messages import (
    AddPeers,
    CancelWrite,
    CheckKV,
    ForgetPeers,
    KVSum,
    Notifs,
    Probe,
    RankState,
    Watch,
    WriteEnded,
    WriteKV,
)
from pdserve.common.kv_transfer.base import KVTransferAgent, KVTransferError, TransferState
from pdserve.common.kv_transfer.pool_metadata import decode_pool_metadata

log = logging.getLogger(__name__)

CANCEL_WAIT_S = 5.0  # how long a cancelled WRITE that the transport cannot abort may take to end


class SenderDuty:
    def __init__(self, rank: int, agent: KVTransferAgent, report: Callable):
        self.rank, self.agent, self.report = rank, agent, report
        self.waiting: dict[int, tuple[WriteKV, object]] = {}  # id -> (order, forward-done event or None)
        self.posted: dict[int, object] = {}  # id -> handle
        self.bad_peers: dict[str, str] = {}  # peer -> why add_peer refused it

    @property
    def active(self) -> bool:
        return bool(self.waiting or self.posted)

    def handle(self, msg, forward_done) -> None:
        if isinstance(msg, WriteKV):
            self.waiting[msg.id] = (msg, forward_done)
        elif isinstance(msg, CancelWrite):
            self._cancel(msg.id)
        elif isinstance(msg, AddPeers):
            for meta in decode_pool_metadata(msg.metadata):  # rank 0 encoded it: trusted
                try:
                    self.agent.add_peer(meta)
                    self.bad_peers.pop(meta.name, None)
                except ValueError as e:
                    self.bad_peers[meta.name] = str(e)
        elif isinstance(msg, ForgetPeers):
            for name in msg.names:
                self.agent.remove_peer(name)
        elif isinstance(msg, Probe):
            self.report(RankState(self.rank, msg.seq, len(self.waiting) + len(self.posted)))

    def poll(self) -> None:
        for id, (order, done) in list(self.waiting.items()):
            if done is not None and not done.query():
                break  # (orders come in launch order: the later ones wait for later forwards)
            del self.waiting[id]
            self._post(order)
        for id, handle in list(self.posted.items()):
            state = self.agent.poll(handle)
            if state is TransferState.IN_PROGRESS:
                continue
            self.agent.release(handle)
            del self.posted[id]
            self.report(
                WriteEnded(
                    id,
                    self.rank,
                    "done" if state is TransferState.DONE else "failed",
                    "" if state is TransferState.DONE else f"WRITE to {handle.peer} failed",
                )
            )

    def _post(self, order: WriteKV) -> None:
        if order.peer in self.bad_peers:
            self.report(WriteEnded(order.id, self.rank, "failed", self.bad_peers[order.peer]))
            return
        try:
            handle = self.agent.write_pages(
                order.peer, order.src_pages, order.dst_pages, order.notif, range(order.head_start, order.head_stop)
            )
        except (KVTransferError, ValueError) as e:
            self.report(WriteEnded(order.id, self.rank, "failed", f"could not start: {e}"))
            return
        self.posted[order.id] = handle

    def _cancel(self, id: int) -> None:
        """Abandon a WRITE before the next message (maybe a forward into its pages) is run."""
        if self.waiting.pop(id, None) is not None:
            self.report(WriteEnded(id, self.rank, "cancelled"))
            return
        handle = self.posted.pop(id, None)
        if handle is None:
            return  # ended already (its report is on its way)
        try:
            self.agent.release(handle)  # aborts it
        except KVTransferError:
            # NOTE: the transport could not abort it: wait (bounded) for it to end, since the
            # next forward may overwrite the pages it reads.
            deadline = time.monotonic() + CANCEL_WAIT_S
            while self.agent.poll(handle) is TransferState.IN_PROGRESS and time.monotonic() < deadline:
                time.sleep(0.0005)
            try:
                self.agent.release(handle)
            except KVTransferError as e:
                log.error("a cancelled KV WRITE could not be ended in %ss: %s", CANCEL_WAIT_S, e)
        self.report(WriteEnded(id, self.rank, "cancelled"))


class ReceiverDuty:
    def __init__(self, rank: int, agent: KVTransferAgent, report: Callable):
        self.rank, self.agent, self.report = rank, agent, report
        self.watching = False

    @property
    def active(self) -> bool:
        return self.watching

    def handle(self, msg, forward_done) -> None:
        if isinstance(msg, Watch):
            self.watching = msg.on
        elif isinstance(msg, CheckKV):
            # NOTE: the pages are safe to read here: the notification that reported the WRITE came
            # after its data, and they are in no batch until every rank's sum has passed (rank 0
            # schedules nothing into them before). On a GPU the read waits for the device, as
            # rank 0's own sum does (integrity.py, cost).
            heads = range(msg.head_start, msg.head_stop)
            self.report(KVSum(self.rank, msg.id, self.agent.checksum(msg.pages, heads)))
        elif isinstance(msg, Probe):
            self.report(RankState(self.rank, msg.seq, 0))

    def poll(self) -> None:
        notifs = self.agent.get_notifs()
        if notifs:
            self.report(Notifs(self.rank, notifs))
