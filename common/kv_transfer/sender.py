"""The sending server's rank 0: one request's KV WRITE, split over every rank of both servers.

    sender = KVSender(server, tp_workers)           server: ServerKV; tp_workers None with tp = 1
    peer = sender.add_peer(destination_metadata)    the receiver's pools (every rank); checked, cached
    group = sender.write(peer, src, dst, room=..., first_token=..., logprobs=...)
    sender.poll(group) -> TransferState             DONE once every WRITE of the group is done
    sender.release(group)                           after DONE/FAILED, or to give up (aborts)

tp_plan.plan_writes says which sending rank WRITEs which heads to which receiving rank. Rank 0
posts its own WRITEs; the others get a WriteKV each (after the Step whose forward computed the
KV: the socket's order) and report its end (WriteEnded). Every WRITE carries its own notification
(room, first token, pages, bytes and the heads it moved) to the receiving rank it lands on: the
receiver completes the room when all its ranks' heads have landed (decode/arrivals.py).

NOTE a group's pages may be reused only after `release`: a rank's WRITE still running then is
cancelled first (CancelWrite precedes, on that rank's socket, any Step that could reuse them).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from pdserve.common.engine.tp_messages import AddPeers, CancelWrite, ForgetPeers, WriteEnded, WriteKV
from pdserve.common.kv_transfer.base import KVTransferError, TransferHandle, TransferState
from pdserve.common.kv_transfer.notif import encode_notif
from pdserve.common.kv_transfer.pool_metadata import PoolMetadata, decode_pool_metadata, encode_pool_metadata
from pdserve.common.kv_transfer.server import ServerKV
from pdserve.common.kv_transfer.tp_plan import Write, plan_writes


@dataclass
class _Peer:
    pools: list[PoolMetadata]  # the receiving server's, by rank
    writes: list[Write]  # the plan from this server's ranks to those


@dataclass
class WriteGroup:
    """One request's WRITEs: rank 0's handles, and the other ranks' WRITEs (id -> rank) not yet ended."""

    peer: str
    num_pages: int
    num_bytes: int  # all ranks' together
    ops: int = 0  # rank 0's WRITEs' NIXL descriptors or device-copy launches (TransferHandle.ops)
    path: str = ""  # how rank 0's WRITEs travel (TransferHandle.path)
    local: list[TransferHandle] = field(default_factory=list)
    remote: dict[int, int] = field(default_factory=dict)
    failure: str | None = None  # a rank's WRITE failed: why
    released: bool = False


class KVSender:
    def __init__(self, server: ServerKV, tp_workers=None):
        self.server, self.workers = server, tp_workers
        self.layout = server.layout
        self.peers: dict[str, _Peer] = {}  # receiving server (its rank 0's agent name) -> pools and plan
        self._by_metadata: dict[bytes, str] = {}  # the metadata a known peer was added with -> its name
        self.open: dict[int, WriteGroup] = {}  # remote WRITE id -> its group
        self._ids = itertools.count(1)

    def add_peer(self, metadata: bytes) -> str:
        """The receiving server in `metadata` (a KVDestination's), ready to be written; its name.
        ValueError, saying why, when it cannot be (undecodable, or a layout this server's pages
        cannot be copied into: page size, dtype, layers, head size, the model's KV heads)."""
        name = self._by_metadata.get(metadata)
        if name is not None and name in self.peers:
            return name  # every request of a burst carries the same bytes: decode them once
        pools = decode_pool_metadata(metadata)
        name = pools[0].name
        known = self.peers.get(name)
        if known is not None and known.pools == pools:
            self._by_metadata[metadata] = name
            return name
        for pool in pools:
            reason = self.layout.compatible_with(pool.layout)
            if reason is not None:
                raise ValueError(
                    f"KV layout of {pool.name!r} (rank {pools.index(pool)} of {len(pools)} of server "
                    f"{name!r}) is incompatible with this server's: {reason}"
                )
        if known is not None:
            self.remove_peer(name)  # restarted under the same name: new addresses
        writes = plan_writes([p.heads for p in self.server.rank_layouts], [p.layout.heads for p in pools])
        for rank in sorted({w.src_rank for w in writes}):
            targets = [pools[j] for j in sorted({w.dst_rank for w in writes if w.src_rank == rank})]
            if rank == 0:
                for pool in targets:
                    self.server.agent.add_peer(pool)
            else:
                self.workers.send_to(rank, AddPeers(encode_pool_metadata(targets)))
        self.peers[name] = _Peer(pools, writes)
        self._by_metadata = {m: n for m, n in self._by_metadata.items() if n != name}
        self._by_metadata[metadata] = name
        return name

    def remove_peer(self, name: str) -> None:
        """Forget a receiving server (a WRITE to it failed: it may have restarted)."""
        peer = self.peers.pop(name, None)
        self._by_metadata = {m: n for m, n in self._by_metadata.items() if n != name}
        if peer is None:
            return
        for pool in peer.pools:
            self.server.agent.remove_peer(pool.name)
        if self.workers is not None:
            self.workers.broadcast(ForgetPeers([p.name for p in peer.pools]))

    def write(
        self,
        peer: str,
        src_pages: list[int],
        dst_pages: list[int],
        *,
        room: int,
        first_token: int,
        logprobs: dict | None,
    ) -> WriteGroup:
        """Post every rank's WRITEs of one request; KVTransferError (nothing left running) or
        ValueError (bad pages) if rank 0's cannot start."""
        target = self.peers.get(peer)
        if target is None:
            raise KVTransferError(f"unknown receiving server {peer!r}: add_peer() its metadata first")
        n = len(src_pages)
        group = WriteGroup(peer, n, 0)
        orders = []
        try:
            for w in target.writes:
                pool = target.pools[w.dst_rank]
                nbytes = pool.layout.transfer_bytes(n, len(w.heads))
                notif = encode_notif(room, first_token, logprobs, n, nbytes, w.heads)
                group.num_bytes += nbytes
                if w.src_rank == 0:
                    handle = self.server.agent.write_pages(pool.name, src_pages, dst_pages, notif, w.heads)
                    group.local.append(handle)
                    group.ops += handle.ops
                    group.path = handle.path
                else:
                    orders.append(
                        (
                            w.src_rank,
                            WriteKV(
                                next(self._ids),
                                pool.name,
                                list(src_pages),
                                list(dst_pages),
                                w.heads.start,
                                w.heads.stop,
                                notif,
                            ),
                        )
                    )
        except BaseException:
            self.release(group)
            raise
        for rank, order in orders:
            self.workers.send_to(rank, order)
            group.remote[order.id] = rank
            self.open[order.id] = group
        return group

    def poll(self, group: WriteGroup) -> TransferState:
        """DONE when every rank's WRITE is; FAILED as soon as one failed; never blocks."""
        self._take_reports()
        states = [self.server.agent.poll(h) for h in group.local]
        if group.failure is None and TransferState.FAILED in states:
            why = next(h.error for h, s in zip(group.local, states) if s is TransferState.FAILED)
            group.failure = f"KV transfer to {group.peer} failed" + (f": {why}" if why else "")
        if group.failure is not None:
            return TransferState.FAILED
        if TransferState.IN_PROGRESS in states or group.remote:
            return TransferState.IN_PROGRESS
        return TransferState.DONE

    def failure(self, group: WriteGroup) -> str:
        return group.failure or f"KV transfer to {group.peer} failed"

    def release(self, group: WriteGroup) -> None:
        """Free the group: rank 0's handles released (aborted if running), the other ranks' WRITEs
        still running cancelled before anything else reaches those ranks."""
        if group.released:
            return
        group.released = True
        for handle in group.local:
            self.server.agent.release(handle)
        for id, rank in group.remote.items():
            self.open.pop(id, None)
            self.workers.send_to(rank, CancelWrite(id))
        group.remote.clear()

    def _take_reports(self) -> None:
        if self.workers is None:
            return
        for ended in self.workers.take(WriteEnded):
            group = self.open.pop(ended.id, None)
            if group is None:
                continue  # released (cancelled) meanwhile
            group.remote.pop(ended.id, None)
            if ended.state != "done" and group.failure is None:
                group.failure = (
                    f"KV transfer to {group.peer} failed on TP rank {ended.rank}: {ended.error or ended.state}"
                )

    def open_transfers(self) -> int:
        return len(self.open)
