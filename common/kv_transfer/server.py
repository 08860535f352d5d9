"""A prefill or decode server's transfer endpoints: one agent per TP rank, each over its own pool.

Rank 0's agent lives in the scheduler process; ranks 1..N-1 open theirs in their own processes and
announce them (common/engine/tp_worker.py). What the server publishes (`metadata()`: the Ready
message, GetAgentMetadata, every KVDestination) lists every rank's pool, rank 0's first, so a peer
of any TP size can WRITE each head where it belongs (tp_plan.py).
"""

from __future__ import annotations

import dataclasses
from functools import cached_property

from pdserve.common.kv_transfer.base import KVLayout, KVTransferAgent
from pdserve.common.kv_transfer.pool_metadata import PoolMetadata, decode_pool_metadata, encode_pool_metadata


class ServerKV:
    def __init__(self, agent: KVTransferAgent, pools: list[PoolMetadata]):
        self.agent = agent  # rank 0's
        self.pools = pools  # every rank's, by rank (pools[0] is agent's)

    @classmethod
    def open(cls, agent_name: str, kv_pool, tp_workers=None, path: str = "auto", verify_kv: bool = False) -> "ServerKV":
        """Rank 0's agent over `kv_pool`, and the other ranks' pools as they announced them. `path`:
        how a sender reaches its peers (direct.py TransferPath; the ranks were given it at their start);
        `verify_kv`: senders add a checksum to every WRITE into this server (integrity.py)."""
        from pdserve.common.kv_transfer.nixl_agent import NixlKVAgent

        agent = NixlKVAgent(agent_name, kv_pool, path=path, verify_kv=verify_kv)
        pools = [agent.metadata()]
        if tp_workers is not None:
            try:
                # (rank 0 checks for them all: decode/kv_checks.py; a sender sums each rank's WRITEs)
                ranks = [decode_pool_metadata(data)[0] for data in tp_workers.rank_pools()]
                pools += [dataclasses.replace(meta, verify_kv=verify_kv) for meta in ranks]
            except BaseException:
                agent.close()
                raise
        return cls(agent, pools)

    @property
    def name(self) -> str:
        return self.agent.name

    @cached_property
    def encoded(self) -> bytes:
        """What a peer needs to WRITE into this server (every rank's pool)."""
        return encode_pool_metadata(self.pools)

    @cached_property
    def layout(self) -> KVLayout:
        """The server's layout: rank 0's, with every KV head of the model (what ServerInfo reports)."""
        first = self.pools[0].layout
        return dataclasses.replace(first, kv_heads=first.model_kv_heads, head_start=0)

    @property
    def rank_layouts(self) -> list[KVLayout]:
        return [p.layout for p in self.pools]

    def close(self) -> None:
        self.agent.close()
