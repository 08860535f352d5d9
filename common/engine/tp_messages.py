"""What a TP server's rank 0 and its other ranks tell each other (msgspec, no pickle).

    rank 0 -> rank r, one ipc PUSH socket per rank, in launch order:
        Step            one launch: its BatchPlan and FutureMap slots (every rank runs it)
        Stop            exit
        AddPeers        a peer server's pools (encoded pool metadata) this rank will WRITE into
        ForgetPeers     drop those peers (a transfer to them failed; they may have restarted)
        WriteKV         WRITE these pages' KV heads to a peer, once the forward before it is done
        CancelWrite     abandon a WriteKV (rank 0 gave up on it); its pages are about to be reused
        Watch           whether transfers into this server are open (poll the agent meanwhile)
        Probe           answer with RankState
        HostCopy        rank 0's host KV tier copied these pages (host_kv_pool.py): copy this rank's heads
        CheckKV         sum these pages' KV heads (integrity.py): a WRITE that landed here, to verify
    rank r -> rank 0, one ipc PULL socket at rank 0:
        RankReady       this rank's pool metadata, once its model and KV pool are up
        WriteEnded      a WriteKV ended: done, failed or cancelled
        Notifs          KV notifications this rank's agent received (rank 0 decides on them)
        RankState       what a Probe asked: transfers this rank still has open
        KVSum           what a CheckKV asked: the sum of those pages as they are in this rank's pool

NOTE the order on rank 0's socket is the contract: a WriteKV follows the Step whose forward wrote
its KV, a HostCopy comes where rank 0's scheduling issued it between two Steps, and a CancelWrite
precedes any Step that may reuse its pages, so a rank never reads KV
before it is computed nor lets a later forward overwrite pages a WRITE is still reading. A CheckKV
precedes any Step whose batch holds its room (rank 0 admits the room only on the KVSum).
"""

from __future__ import annotations

import msgspec
import numpy as np

from pdserve.common.engine.batch import BatchPlan
from pdserve.common.scheduling.batch import ForwardMode


class Step(msgspec.Struct, tag=True, array_like=True):
    """One launch: a BatchPlan and the FutureMap slots its sampled ids go to."""

    mode: str
    packed: bytes  # int64
    num_tokens: int
    seq_lens: list[int]
    extend_lens: list[int]
    extend_starts: list[int]
    req_rows: list[int]
    samples: list[bool]
    has_placeholders: bool
    row_writes: bytes  # int64 [3, N]; empty: none
    seq: int
    first_slot: int
    prompt_logprobs: bytes = b""  # int64 [2, M]; empty: none
    prompt_top_n: int = 0
    verify: bool = False  # a verify step (speculative decoding): every position sampled
    verify_spec: bytes = b""  # int64 VerifySpec.plan upload; empty: none
    verify_moves: bool = False

    @classmethod
    def of(cls, plan: BatchPlan, slots: list[int]) -> "Step":
        rw, scored = plan.row_writes, plan.prompt_logprobs
        return cls(
            plan.mode.value,
            plan.packed.tobytes(),
            plan.num_tokens,
            plan.seq_lens,
            plan.extend_lens,
            plan.extend_starts,
            plan.req_rows,
            plan.samples,
            plan.has_placeholders,
            rw.tobytes() if rw is not None else b"",
            plan.seq,
            slots[0] if slots else 0,
            scored.tobytes() if scored is not None else b"",
            plan.prompt_top_n,
            plan.verify,
            plan.verify_spec.tobytes() if plan.verify_spec is not None else b"",
            plan.verify_moves,
        )

    def plan(self) -> BatchPlan:
        mode = ForwardMode(self.mode)
        packed = np.frombuffer(self.packed, dtype=np.int64).copy()  # writable, as torch wants
        if mode is ForwardMode.DECODE:
            packed = packed.reshape(6, -1)
        rw = np.frombuffer(self.row_writes, dtype=np.int64).reshape(3, -1).copy() if self.row_writes else None
        scored = (
            np.frombuffer(self.prompt_logprobs, dtype=np.int64).reshape(2, -1).copy() if self.prompt_logprobs else None
        )
        return BatchPlan(
            mode,
            packed,
            self.num_tokens,
            self.seq_lens,
            self.extend_lens,
            self.extend_starts,
            self.req_rows,
            self.samples,
            self.has_placeholders,
            rw,
            self.seq,
            scored,
            self.prompt_top_n,
            self.verify,
            np.frombuffer(self.verify_spec, dtype=np.int64).copy() if self.verify_spec else None,
            self.verify_moves,
        )

    @property
    def slots(self) -> list[int]:
        return list(range(self.first_slot, self.first_slot + len(self.req_rows)))


class Stop(msgspec.Struct, tag=True, array_like=True):
    """Rank 0 is closing: exit."""


class AddPeers(msgspec.Struct, tag=True, array_like=True):
    metadata: bytes  # pool_metadata.encode_pool_metadata of the peer ranks this rank writes to


class ForgetPeers(msgspec.Struct, tag=True, array_like=True):
    names: list[str]


class WriteKV(msgspec.Struct, tag=True, array_like=True):
    id: int
    peer: str
    src_pages: list[int]
    dst_pages: list[int]
    head_start: int
    head_stop: int
    notif: bytes


class CancelWrite(msgspec.Struct, tag=True, array_like=True):
    id: int


class Watch(msgspec.Struct, tag=True, array_like=True):
    on: bool


class Probe(msgspec.Struct, tag=True, array_like=True):
    seq: int


class HostCopy(msgspec.Struct, tag=True, array_like=True):
    op: str  # "store" (device -> host) | "load" (host -> device)
    pages: list[int]
    slots: list[int]


class CheckKV(msgspec.Struct, tag=True, array_like=True):
    id: int
    pages: list[int]
    head_start: int
    head_stop: int


class RankReady(msgspec.Struct, tag=True, array_like=True):
    rank: int
    metadata: bytes  # encode_pool_metadata([this rank's pool])


class WriteEnded(msgspec.Struct, tag=True, array_like=True):
    id: int
    rank: int
    state: str  # "done" | "failed" | "cancelled"
    error: str = ""


class Notifs(msgspec.Struct, tag=True, array_like=True):
    rank: int
    notifs: list[tuple[str, bytes]]  # (sending agent, notification)


class RankState(msgspec.Struct, tag=True, array_like=True):
    rank: int
    seq: int
    open_transfers: int


class KVSum(msgspec.Struct, tag=True, array_like=True):
    rank: int
    id: int  # the CheckKV's
    sum: int


ToRank = Step | Stop | AddPeers | ForgetPeers | WriteKV | CancelWrite | Watch | Probe | HostCopy | CheckKV
FromRank = RankReady | WriteEnded | Notifs | RankState | KVSum

to_rank_decoder = msgspec.msgpack.Decoder(ToRank)
from_rank_decoder = msgspec.msgpack.Decoder(FromRank)
encoder = msgspec.msgpack.Encoder()
