"""KV pages between two processes on one host by a device copy through CUDA IPC: no NIXL data path.

Where it applies: the decode pool lives on this process's GPU, or on another GPU of this host that
this one can reach (NVLink or PCIe peer access). CUDA IPC maps the peer's allocation into this
process even where `CUDA_VISIBLE_DEVICES` hides the peer's GPU from it (measured on two H200s: a
device copy into the mapped pool of the other GPU ran at ~360 GiB/s), so `pdserve up`'s one GPU per
server is no obstacle. Peers on other hosts, or whose pool cannot be mapped, go through NIXL.

Why (docs/benchmarks/transfers.md, "One GPU, both roles: the same-GPU KV copy" and "Two GPUs: KV by
device copy"): a NIXL WRITE posts one UCX copy per descriptor (at least one per layer, K or V, and page
run: 24 for one GPT-2-small prompt; 288 when the pools were head-major, ~3-4 ms of the prefill
scheduler's time per request). Here the decode server's pool is mapped into the prefill process once
(CUDA IPC handles, published with the pool's metadata), and a WRITE is one kernel launch on a stream of
its own (every layer's K and V, every page: page_copy_kernel.py; `copy_pages`, two launches per buffer,
is the reference it is tested against). On another GPU the kernel's stores travel over the link. The
notification still goes through NIXL (`send_notif`), after the copy's event has completed, so the decode
side cannot tell the two paths apart.

NOTE (visibility): a peer GPU's stores are visible to its owner once the copy kernel has completed
(the event): the notification leaves only then, and the decode side reads the pages in later work.

Same checks as a NIXL WRITE: the pages and heads are checked against both layouts before anything
is queued (NixlKVAgent.write_pages). `--kv-transfer-path nixl` keeps NIXL's data path (to compare,
or to measure the path between hosts on one host); `direct` refuses a peer it cannot map.

NOTE: like a NIXL WRITE (which reads the source when posted), a copy is queued only for pages whose
forward has completed on the device: the prefill scheduler starts a transfer after
`copy_done.synchronize()` of the batch that computed them, so no stream wait is needed here.
"""

from __future__ import annotations

import enum
import logging
import socket
from dataclasses import dataclass, field

import numpy as np
import torch

from pdserve.common.engine.overlap import h2d_array
from pdserve.common.kv_transfer.base import KVLayout, TransferHandle
from pdserve.common.kv_transfer.pages import one_run, page_rows
from pdserve.common.kv_transfer.pool_metadata import PoolMetadata

logger = logging.getLogger(__name__)


class TransferPath(str, enum.Enum):
    """How a sender moves KV into a peer's pool (`--kv-transfer-path`)."""

    AUTO = "auto"  # a device copy wherever the peer's pool can be mapped (this host), else NIXL
    DIRECT = "direct"  # a device copy, or the peer is refused (add_peer raises)
    NIXL = "nixl"  # always NIXL's data path, as between hosts


# The GPU pools of this process's own agents, by agent name. Two engines in one process (the tests,
# `pdserve bench transfer`) cannot map each other through CUDA IPC: the driver refuses to open a
# handle in the process that made it, and NIXL's UCX scatter-gather has no put between two pools of
# one process (its cuda_copy transport: "cannot find remote protocol ... put from sgl"). A device
# copy reads and writes such a peer's buffers themselves.
_LOCAL_POOLS: dict[str, list[torch.Tensor]] = {}


def register_local_pool(name: str, buffers: list[torch.Tensor]) -> None:
    _LOCAL_POOLS[name] = buffers


def unregister_local_pool(name: str) -> None:
    _LOCAL_POOLS.pop(name, None)


def in_this_process(peer: PoolMetadata) -> bool:
    """Whether `peer` is a GPU pool of an agent in this process (register_local_pool). (A peer on this
    process's own GPU gets the device copy below; NixlKVAgent.add_peer refuses NIXL's scatter-gather to it.)"""
    local = _LOCAL_POOLS.get(peer.name)
    return local is not None and local[0].data_ptr() == peer.k_addrs[0]


def host_id() -> str:
    """This host's identity for CUDA IPC: its boot id (a container shares its host's), else its name.
    Only pools with the same id are ever mapped: an IPC handle means nothing on another host."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


def gpu_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def share_buffers(buffers: list[torch.Tensor]) -> tuple[tuple, ...]:
    """CUDA IPC handles of the pool's buffers (K of every layer, then V), JSON-able."""
    shared = []
    for buffer in buffers:
        storage = buffer.untyped_storage()
        _, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync = storage._share_cuda_()
        shared.append(
            (
                handle.hex(),
                size,
                offset,
                ref_handle.hex(),
                ref_offset,
                event_handle.hex(),
                event_sync,
                buffer.storage_offset(),
            )
        )
    return tuple(shared)


def open_buffers(shared: tuple[tuple, ...], layout: KVLayout, device: torch.device) -> list[torch.Tensor]:
    """The peer's buffers mapped into this process, as page views (page_view)."""
    views = []
    itemsize = getattr(torch, layout.dtype).itemsize
    for handle, size, offset, ref_handle, ref_offset, event_handle, event_sync, storage_offset in shared:
        storage = torch.UntypedStorage._new_shared_cuda(
            device.index,
            bytes.fromhex(handle),
            size,
            offset,
            bytes.fromhex(ref_handle),
            ref_offset,
            bytes.fromhex(event_handle),
            event_sync,
        )
        flat = torch.empty(0, dtype=torch.uint8, device=device).set_(storage)
        start = storage_offset * itemsize
        views.append(page_view(flat[start : start + _buffer_bytes(layout)], layout))
    return views


def page_view(buffer: torch.Tensor, layout: KVLayout) -> torch.Tensor:
    """A layer's K or V buffer as [pages, page_size, heads, head bytes] bytes."""
    head_bytes = layout.head_page_bytes // layout.page_size
    return buffer.view(torch.uint8).view(layout.num_pages, layout.page_size, layout.kv_heads, head_bytes)


def _buffer_bytes(layout: KVLayout) -> int:
    return layout.num_pages * layout.page_bytes


def copy_pages(
    src: list[torch.Tensor],
    dst: list[torch.Tensor],
    src_pages: list[int],
    dst_pages: list[int],
    src_heads: range,
    dst_heads: range,
) -> None:
    """dst[b][dst_pages, :, dst_heads] = src[b][src_pages, :, src_heads] for every buffer b (page
    views), on the current stream: one gather and one scatter per buffer."""
    device = dst[0].device
    index = h2d_array(np.array([src_pages, dst_pages], dtype=np.int64), device)
    src_index, dst_index = index[0], index[1]
    for source, target in zip(src, dst, strict=True):
        rows = source[:, :, src_heads.start : src_heads.stop].index_select(0, src_index)
        target[:, :, dst_heads.start : dst_heads.stop].index_copy_(0, dst_index, rows)


class DirectHandle(TransferHandle):
    """A queued copy: done once `event` has completed and the notification has gone out."""

    path = "device_copy"

    def __init__(self, peer: str, num_pages: int, num_bytes: int, event, notif: bytes, ops: int = 1):
        super().__init__(peer, num_pages, num_bytes, ops)
        self.event, self.notif = event, notif
        self.notified = False
        self.released = False


@dataclass
class _Mapped:
    """A peer's pool mapped into this process: its page views (kept: they hold the IPC mappings),
    their addresses as the copy kernel's table, and its page count."""

    views: list[torch.Tensor]
    table: torch.Tensor
    layout: KVLayout
    rows: dict = field(default_factory=dict)  # (own heads, its heads) -> page_rows' pair, worked out once


class DirectPeers:
    """The pools of peers on this host mapped into this process (once each), and the stream copies
    run on."""

    def __init__(self, device: torch.device, own: list[torch.Tensor], layout: KVLayout, path: TransferPath):
        from pdserve.common.kv_transfer.page_copy_kernel import address_table

        self.device = device
        self.path = TransferPath(path)
        self.uuid = gpu_uuid(device)
        self.host = host_id()
        self.layout = layout
        self.own = [page_view(b, layout) for b in own]
        self.own_table = address_table(self.own)
        self.stream = torch.cuda.Stream(device)
        self.peers: dict[str, _Mapped] = {}
        self.spare_events: list[torch.cuda.Event] = []  # of released copies: recorded again, not made again

    def add(self, peer: PoolMetadata) -> str | None:
        """Map `peer`'s pool if a device copy can reach it; say how ("this GPU", "peer GPU <uuid>"),
        or None when NIXL carries its pages. With TransferPath.DIRECT a pool that cannot be mapped
        raises ValueError instead."""
        from pdserve.common.kv_transfer.page_copy_kernel import address_table

        if self.path is TransferPath.NIXL:
            return None
        why_not = None
        if in_this_process(peer) and peer.gpu_uuid == self.uuid:
            views = [page_view(b, peer.layout) for b in _LOCAL_POOLS[peer.name]]
            self.peers[peer.name] = _Mapped(views, address_table(views), peer.layout)
            route = "this GPU" if peer.gpu_uuid == self.uuid else f"peer GPU {peer.gpu_uuid}"
            logger.info("KV pages to %r are copied within this process (%s)", peer.name, route)
            return route
        if not peer.ipc_buffers:
            why_not = "its pool is not on a GPU" if peer.mem_type != "VRAM" else "it published no CUDA IPC handles"
        elif peer.host_id != self.host:
            why_not = "it is on another host"
        if why_not is None:
            try:
                views = open_buffers(peer.ipc_buffers, peer.layout, self.device)
                self.peers[peer.name] = _Mapped(views, address_table(views), peer.layout)
            except RuntimeError as error:  # (no peer access between the GPUs, a driver without IPC, ...)
                why_not = f"its pool cannot be mapped here ({error})"
        if why_not is not None:
            if self.path is TransferPath.DIRECT:
                raise ValueError(f"--kv-transfer-path direct, but no device copy can reach {peer.name!r}: {why_not}")
            if peer.mem_type == "VRAM":
                logger.info("KV pages to %r go through NIXL: %s", peer.name, why_not)
            return None
        route = "this GPU" if peer.gpu_uuid == self.uuid else f"peer GPU {peer.gpu_uuid}"
        logger.info("KV pages to %r are copied through CUDA IPC (%s)", peer.name, route)
        return route

    def remove(self, name: str) -> None:
        self.peers.pop(name, None)

    def write(
        self,
        peer: str,
        src_pages: list[int],
        dst_pages: list[int],
        src_heads: range,
        dst_heads: range,
        num_bytes: int,
        notif: bytes,
    ) -> DirectHandle:
        from pdserve.common.kv_transfer.page_copy_kernel import copy_pages_fused

        target = self.peers[peer]
        rows = target.rows.get((src_heads, dst_heads))
        if rows is None:
            rows = target.rows[(src_heads, dst_heads)] = page_rows(self.layout, src_heads, target.layout, dst_heads)
        event = self.spare_events.pop() if self.spare_events else torch.cuda.Event()
        with torch.cuda.stream(self.stream):
            if one_run(src_pages, dst_pages):  # (the common case: no page index to upload)
                copy_pages_fused(self.own_table, target.table, src_pages[0], dst_pages[0], *rows, run=len(src_pages))
            else:
                index = h2d_array(np.array([src_pages, dst_pages], dtype=np.int64), self.device)
                copy_pages_fused(self.own_table, target.table, index[0], index[1], *rows)
            event.record(self.stream)
        return DirectHandle(peer, len(src_pages), num_bytes, event, notif)

    def recycle(self, handle: DirectHandle) -> None:
        """A released copy's event (it has completed) for a later copy to record."""
        if isinstance(handle.event, torch.cuda.Event):
            self.spare_events.append(handle.event)
