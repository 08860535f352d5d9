"""What a server publishes about its KV pools so that a peer can WRITE into them: one entry per TP
rank (each rank has its own agent and pool, holding its own KV heads).

Wire format (version 3), no pickle:
    struct "!4sHI": magic b"PDKV", version, length J of the JSON part
    J bytes of JSON: {"ranks": [{name, layout, mem_type, device_id, k_addrs, v_addrs, transport_len,
                                 gpu_uuid, ipc_buffers, host_id, verify_kv}, ...]}   (the last four optional)
    the rest: the ranks' transport metadata (opaque bytes), one after another, transport_len each

Versions 1 and 2 are refused: their pages mean other bytes (version 2's pools were head-major,
version 3's are token-major). Roll prefill and decode servers together across a change
(docs/deploy/troubleshoot.md).
"""

from __future__ import annotations

import json
import struct
from dataclasses import asdict, dataclass
from typing import Sequence

from pdserve.common.kv_transfer.base import KVLayout

MAGIC = b"PDKV"
VERSION = 3
_HEADER = struct.Struct("!4sHI")


@dataclass(frozen=True)
class PoolMetadata:
    """A pool as seen from a peer. `mem_type` is "DRAM" or "VRAM"; `device_id` is the GPU index
    (0 for DRAM); k_addrs[l], v_addrs[l] are the base addresses of layer l's K and V buffers."""

    name: str
    layout: KVLayout
    mem_type: str
    device_id: int
    k_addrs: tuple[int, ...]
    v_addrs: tuple[int, ...]
    transport_metadata: bytes
    # A CUDA pool's GPU (its UUID), its buffers' CUDA IPC handles and its host (common/kv_transfer/direct.py),
    # so that a peer on the same host copies pages itself; empty for DRAM pools.
    gpu_uuid: str = ""
    ipc_buffers: tuple = ()
    host_id: str = ""
    # The receiver checks each WRITE's checksum (integrity.py): a sender adds one to every notification.
    verify_kv: bool = False


def encode_pool_metadata(ranks: Sequence[PoolMetadata]) -> bytes:
    """A server's pools, rank 0's first."""
    fields = [
        {
            "name": meta.name,
            "layout": asdict(meta.layout),
            "mem_type": meta.mem_type,
            "device_id": meta.device_id,
            "k_addrs": list(meta.k_addrs),
            "v_addrs": list(meta.v_addrs),
            "transport_len": len(meta.transport_metadata),
            "gpu_uuid": meta.gpu_uuid,
            "ipc_buffers": list(meta.ipc_buffers),
            "host_id": meta.host_id,
            "verify_kv": meta.verify_kv,
        }
        for meta in ranks
    ]
    body = json.dumps({"ranks": fields}, separators=(",", ":")).encode()
    return _HEADER.pack(MAGIC, VERSION, len(body)) + body + b"".join(meta.transport_metadata for meta in ranks)


def decode_pool_metadata(data: bytes) -> list[PoolMetadata]:
    """The pools in `data`, rank 0's first; ValueError, saying what is wrong, for anything else."""
    if len(data) < _HEADER.size:
        raise ValueError(f"KV pool metadata too short ({len(data)} bytes)")
    magic, version, body_len = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise ValueError(f"not pdserve KV pool metadata (magic {magic!r}, expected {MAGIC!r})")
    if version != VERSION:
        raise ValueError(
            f"KV pool metadata version {version}, this side speaks version {VERSION} "
            "(prefill and decode servers must run the same pdserve release)"
        )
    body_end = _HEADER.size + body_len
    if len(data) < body_end:
        raise ValueError(f"KV pool metadata truncated ({len(data)} bytes, header says at least {body_end})")
    ranks, offset = [], body_end
    try:
        for fields in json.loads(data[_HEADER.size : body_end])["ranks"]:
            end = offset + int(fields["transport_len"])
            if end > len(data):
                raise ValueError(f"KV pool metadata truncated ({len(data)} bytes, its ranks need {end})")
            ranks.append(
                PoolMetadata(
                    name=fields["name"],
                    layout=KVLayout(**fields["layout"]),
                    mem_type=fields["mem_type"],
                    device_id=fields["device_id"],
                    k_addrs=tuple(fields["k_addrs"]),
                    v_addrs=tuple(fields["v_addrs"]),
                    transport_metadata=bytes(data[offset:end]),
                    gpu_uuid=str(fields.get("gpu_uuid", "")),
                    ipc_buffers=tuple(tuple(b) for b in fields.get("ipc_buffers", ())),
                    host_id=str(fields.get("host_id", "")),
                    verify_kv=fields.get("verify_kv", False) is True,
                )
            )
            offset = end
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as error:
        raise ValueError(f"malformed KV pool metadata: {error!r}") from error
    if not ranks:
        raise ValueError("KV pool metadata lists no pool")
    for meta in ranks:
        if meta.mem_type not in ("DRAM", "VRAM"):
            raise ValueError(f"KV pool metadata of {meta.name!r} has memory type {meta.mem_type!r}, not DRAM or VRAM")
        if len(meta.k_addrs) != meta.layout.num_layers or len(meta.v_addrs) != meta.layout.num_layers:
            raise ValueError(
                f"KV pool metadata of {meta.name!r} has {len(meta.k_addrs)} K and {len(meta.v_addrs)} V addresses "
                f"for {meta.layout.num_layers} layers"
            )
        heads = meta.layout.heads
        if heads.start < 0 or heads.stop > meta.layout.model_kv_heads or not heads:
            raise ValueError(
                f"KV pool metadata of {meta.name!r} holds KV heads [{heads.start}, {heads.stop}) "
                f"of a model with {meta.layout.model_kv_heads}"
            )
    return ranks
