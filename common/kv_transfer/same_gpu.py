"""KV pages between two processes on one GPU: a device copy through CUDA IPC, no NIXL data path.

Why (docs/benchmarks.md, "One GPU, both roles"): a NIXL WRITE posts one UCX copy per descriptor,
and a head-major pool needs one descriptor per (layer, K or V, head, page run) — 288 for one
GPT-2-small prompt. On an H200 with a prefill and a decode server under MPS, posting them took
the prefill scheduler ~4 ms per request (85% of its time): the pair served ~200 prompts/s. Here
the decode server's pool is mapped into the prefill process once (CUDA IPC handles, published
with the pool's metadata), and a WRITE is one kernel launch on a stream of its own (every layer's K
and V, every head and page: page_copy_kernel.py; `copy_pages`, two launches per buffer, is the
reference it is tested against). The notification still goes through NIXL (`send_notif`), after the
copy's event has completed, so the decode side cannot tell the two paths apart.

Same checks as a NIXL WRITE: the pages and heads are checked against both layouts before anything
is queued (NixlKVAgent.write_pages). `PDSERVE_KV_SAME_GPU=nixl` keeps NIXL's data path (to compare).

NOTE: like a NIXL WRITE (which reads the source when posted), a copy is queued only for pages whose
forward has completed on the device: the prefill scheduler starts a transfer after
`copy_done.synchronize()` of the batch that computed them, so no stream wait is needed here.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import numpy as np
import torch

from pdserve.common.engine.overlap import h2d_array
from pdserve.common.kv_transfer.base import KVLayout, TransferHandle

logger = logging.getLogger(__name__)

ENV = "PDSERVE_KV_SAME_GPU"  # "nixl": send same-GPU pages through NIXL as to another GPU


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
    """The peer's buffers mapped into this process, as [heads, pages, head page bytes] uint8 views."""
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
    """A layer's K or V buffer as [heads, pages, head page bytes] bytes."""
    return buffer.view(torch.uint8).view(layout.kv_heads, layout.num_pages, layout.head_page_bytes)


def _buffer_bytes(layout: KVLayout) -> int:
    return layout.kv_heads * layout.num_pages * layout.head_page_bytes


def copy_pages(
    src: list[torch.Tensor],
    dst: list[torch.Tensor],
    src_pages: list[int],
    dst_pages: list[int],
    src_heads: range,
    dst_heads: range,
) -> None:
    """dst[b][dst_heads, dst_pages] = src[b][src_heads, src_pages] for every buffer b (page views),
    on the current stream: one gather and one scatter per buffer."""
    device = dst[0].device
    index = h2d_array(np.array([src_pages, dst_pages], dtype=np.int64), device)
    src_index, dst_index = index[0], index[1]
    for source, target in zip(src, dst, strict=True):
        rows = source[src_heads.start : src_heads.stop].index_select(1, src_index)
        target[dst_heads.start : dst_heads.stop].index_copy_(1, dst_index, rows)


class SameGpuHandle(TransferHandle):
    """A queued copy: done once `event` has completed and the notification has gone out."""

    def __init__(self, peer: str, num_pages: int, num_bytes: int, event, notif: bytes):
        super().__init__(peer, num_pages, num_bytes)
        self.event, self.notif = event, notif
        self.notified = False
        self.released = False


@dataclass
class _Mapped:
    """A peer's pool mapped into this process: its page views (kept: they hold the IPC mappings),
    their addresses as the copy kernel's table, and its page count."""

    views: list[torch.Tensor]
    table: torch.Tensor
    num_pages: int


class SameGpuPeers:
    """The pools of peers on this process's GPU, mapped once each, and the stream copies run on."""

    def __init__(self, device: torch.device, own: list[torch.Tensor], layout: KVLayout):
        from pdserve.common.kv_transfer.page_copy_kernel import address_table

        self.device = device
        self.uuid = gpu_uuid(device)
        self.layout = layout
        self.own = [page_view(b, layout) for b in own]
        self.own_table = address_table(self.own)
        self.stream = torch.cuda.Stream(device)
        self.peers: dict[str, _Mapped] = {}

    @staticmethod
    def enabled() -> bool:
        return os.environ.get(ENV, "ipc") != "nixl"

    def add(self, name: str, uuid: str, shared: tuple[tuple, ...], layout: KVLayout) -> bool:
        """Map peer `name`'s pool if it lives on this GPU; False (NIXL carries its pages) otherwise."""
        if not shared or uuid != self.uuid or not self.enabled():
            return False
        from pdserve.common.kv_transfer.page_copy_kernel import address_table

        try:
            views = open_buffers(shared, layout, self.device)
            self.peers[name] = _Mapped(views, address_table(views), layout.num_pages)
        except RuntimeError as error:  # (e.g. a driver without IPC between these two processes)
            logger.warning("cannot map the KV pool of %r on this GPU (%s): its pages go through NIXL", name, error)
            return False
        logger.info("KV pages to %r are copied on this GPU through CUDA IPC", name)
        return True

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
    ) -> SameGpuHandle:
        from pdserve.common.kv_transfer.page_copy_kernel import copy_pages_fused

        target = self.peers[peer]
        with torch.cuda.stream(self.stream):
            index = h2d_array(np.array([src_pages, dst_pages], dtype=np.int64), self.device)
            copy_pages_fused(
                self.own_table,
                target.table,
                index[0],
                index[1],
                src_heads,
                dst_heads,
                self.layout.num_pages,
                target.num_pages,
                self.layout.head_page_bytes,
            )
            event = torch.cuda.Event()
            event.record(self.stream)
        return SameGpuHandle(peer, len(src_pages), num_bytes, event, notif)
