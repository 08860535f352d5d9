"""KVTransferAgent over NIXL: one-sided WRITEs from this pool into a peer's pool.

The whole pool (every layer's K and V storage, token-major) is registered once, at construction, as
DRAM for CPU tensors or VRAM for CUDA tensors, and prepared as one NIXL descriptor list; each peer's
pool is prepared when it is added (prepped.py). A `write_pages` is then index arithmetic in numpy
and one `make_prepped_xfer` + post carrying the notification (2 x layers descriptors a request
whose pages are one run on both sides) — unless the peer's pool is on this
host's GPUs and could be mapped (direct.py): then a WRITE is one device copy, and only its
notification goes through NIXL.

Why this file is long: one agent serves both paths (NIXL and the device copy) behind one interface,
with the checks both share (pages, heads, peers, the integrity checksum) in one place.
"""

from __future__ import annotations

import logging
import os

import nixl._bindings as nixl_bindings
from nixl._api import nixl_agent, nixl_xfer_handle

from pdserve.common.engine.kv_pool import PagedKVPool
from pdserve.common.kv_transfer import early_agent, faults
from pdserve.common.kv_transfer.base import KVLayout, KVTransferAgent, KVTransferError, TransferHandle, TransferState
from pdserve.common.kv_transfer.direct import (
    DirectHandle,
    DirectPeers,
    TransferPath,
    gpu_uuid,
    host_id,
    in_this_process,
    page_view,
    register_local_pool,
    share_buffers,
    unregister_local_pool,
)
from pdserve.common.kv_transfer.early_agent import SGL_ENV
from pdserve.common.kv_transfer.integrity import kv_checksum
from pdserve.common.kv_transfer.notif import with_checksum
from pdserve.common.kv_transfer.pages import check_pages, coalesce_runs, one_run, page_rows, run_descriptors
from pdserve.common.kv_transfer.pool_metadata import PoolMetadata
from pdserve.common.kv_transfer.prepped import page_indices, preparable, strided_rows

logger = logging.getLogger(__name__)

# The NIXL bindings raise their own classes (nixlNotFoundError, nixlBackendError, ...), all
# straight subclasses of Exception, so they are collected by name rather than by a common base.
_NIXL_ERRORS = tuple(
    cls
    for name, cls in vars(nixl_bindings).items()
    if name.startswith("nixl") and name.endswith("Error") and isinstance(cls, type) and issubclass(cls, Exception)
)


_XFER_STATES = {"DONE": TransferState.DONE, "PROC": TransferState.IN_PROGRESS}


class NixlTransferHandle(TransferHandle):
    def __init__(self, peer: str, num_pages: int, num_bytes: int, xfer: nixl_xfer_handle, ops: int):
        super().__init__(peer, num_pages, num_bytes, ops)
        self.xfer = xfer
        self.released = False


class NixlKVAgent(KVTransferAgent):
    """A NIXL agent named `name` (unique among the agents that will talk) over `kv_pool`; `path`
    says whether peers this host's GPUs can reach get device copies (direct.py TransferPath)."""

    def __init__(
        self,
        name: str,
        kv_pool: PagedKVPool,
        backend: str = "UCX",
        path: TransferPath | str = TransferPath.AUTO,
        verify_kv: bool = False,
    ):
        buffers = [*kv_pool.k_storage, *kv_pool.v_storage]
        device = buffers[0].device
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"NIXL transfers need a CPU or CUDA KV pool, this one is on {device}")
        if any(b.device != device or not b.is_contiguous() for b in buffers):
            raise ValueError("every K/V buffer of the pool must be contiguous and on one device")
        path = TransferPath(path)
        if path is TransferPath.DIRECT and device.type != "cuda":
            raise ValueError(
                "--kv-transfer-path direct needs a CUDA KV pool (a device copy); on the CPU use auto or nixl"
            )
        self.name = name
        self.layout = KVLayout.of_pool(kv_pool)
        # Holding the pool keeps the registered tensors alive for as long as peers may write to them.
        self._pool = kv_pool
        self._mem_type = "DRAM" if device.type == "cpu" else "VRAM"
        self._device_id = 0 if device.type == "cpu" else device.index
        self._k_addrs = tuple(b.data_ptr() for b in kv_pool.k_storage)
        self._v_addrs = tuple(b.data_ptr() for b in kv_pool.v_storage)

        # (its configuration, the progress thread's and UCX scatter-gather's: early_agent.agent_config; a GPU
        # server's agent was begun on a thread while its model loaded)
        self._agent: nixl_agent | None = early_agent.take(name) or nixl_agent(
            name, early_agent.agent_config(device, backend)
        )
        if backend not in self._agent.backends:
            # nixl_agent only logs a warning for a missing plugin; registration would then fail obscurely.
            raise KVTransferError(
                f"NIXL has no {backend} backend on this machine (plugins: {self._agent.get_plugin_list()})"
            )
        # Peers on this host's GPUs get their pages by a device copy through CUDA IPC (common/kv_transfer/direct.py).
        self._direct = DirectPeers(device, buffers, self.layout, path) if device.type == "cuda" else None
        regions = [(b.data_ptr(), b.nbytes, self._device_id, "") for b in buffers]
        self._registered = self._agent.register_memory(regions, self._mem_type)
        self._prepped = None  # this pool as a prepared list (None: too many descriptors to index)
        if preparable(self.layout):
            rows = strided_rows(self._k_addrs, self._v_addrs, self.layout, self._device_id)
            self._prepped = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", rows, self._mem_type)
        # Taken after registration: the agent metadata carries the registered regions' remote keys.
        self._metadata = PoolMetadata(
            name=name,
            layout=self.layout,
            mem_type=self._mem_type,
            device_id=self._device_id,
            k_addrs=self._k_addrs,
            v_addrs=self._v_addrs,
            transport_metadata=self._agent.get_agent_metadata(),
            gpu_uuid=gpu_uuid(device) if device.type == "cuda" else "",
            ipc_buffers=share_buffers(buffers) if device.type == "cuda" else (),
            host_id=host_id() if device.type == "cuda" else "",
            verify_kv=verify_kv,
        )
        self._views = [page_view(b, self.layout) for b in buffers]  # (checksums: integrity.py)
        if device.type == "cuda":
            register_local_pool(name, buffers)
        self._peers: dict[str, PoolMetadata] = {}
        self._routes: dict[str, str] = {}  # peer -> how its WRITEs travel (route())
        self._peer_prepped: dict[str, object] = {}  # peer -> its pool as a prepared list
        self._rows: dict[tuple[str, range], tuple] = {}  # (peer, heads) -> page_rows of a WRITE to it
        self._faults = faults.from_env()  # (tests only: faults.py)
        self._live: set[NixlTransferHandle] = set()

    def metadata(self) -> PoolMetadata:
        return self._metadata

    def add_peer(self, metadata: PoolMetadata) -> str:
        agent = self._open_agent()
        peer = metadata
        if peer.name == self.name:
            raise ValueError(f"peer metadata carries this agent's own name {self.name!r}; agent names must be unique")
        reason = self.layout.compatible_with(peer.layout)
        if reason is not None:
            raise ValueError(f"peer {peer.name!r} has an incompatible KV layout: {reason}")
        known = self._peers.get(peer.name)
        if known == peer:
            return peer.name
        if known is not None:
            # Same name, new content: the peer restarted, with new addresses and a new endpoint.
            self.remove_peer(peer.name)
        try:
            loaded = agent.add_remote_agent(peer.transport_metadata)
        except _NIXL_ERRORS as error:
            raise ValueError(f"NIXL could not load the metadata of peer {peer.name!r}: {error!r}") from error
        loaded_name = loaded.decode() if isinstance(loaded, bytes) else loaded
        if loaded_name != peer.name:
            if loaded_name not in self._peers:
                agent.remove_remote_agent(loaded_name)
            raise ValueError(f"peer metadata names {peer.name!r} but its NIXL agent is {loaded_name!r}")
        route = None
        if self._direct is not None:
            try:
                route = self._direct.add(peer)
            except ValueError:
                agent.remove_remote_agent(peer.name)
                raise
        if route is None and self._direct is not None and self._sgl_cannot_reach(peer):
            agent.remove_remote_agent(peer.name)
            raise ValueError(
                f"peer {peer.name!r} is a pool on this GPU in this process: NIXL's UCX scatter-gather cannot "
                f"put into it (set {SGL_ENV}=0, or leave --kv-transfer-path at auto for a device copy)"
            )
        if route is None and self._prepped is not None and preparable(peer.layout):
            rows = strided_rows(peer.k_addrs, peer.v_addrs, peer.layout, peer.device_id)
            try:
                self._peer_prepped[peer.name] = agent.prep_xfer_dlist(peer.name, rows, peer.mem_type)
            except _NIXL_ERRORS as error:
                if self._direct is not None:
                    self._direct.remove(peer.name)
                agent.remove_remote_agent(peer.name)
                raise ValueError(f"NIXL could not prepare the pool of peer {peer.name!r}: {error!r}") from error
        self._peers[peer.name] = peer
        self._routes[peer.name] = f"device copy ({route})" if route else "NIXL"
        return peer.name

    def _sgl_cannot_reach(self, peer: PoolMetadata) -> bool:
        """UCX has no scatter-gather put between two pools of one GPU in one process (its cuda_copy
        transport; every WRITE would fail with "cannot find remote protocol"): refused when adding it."""
        same_gpu = peer.gpu_uuid == self._direct.uuid
        return same_gpu and in_this_process(peer) and os.environ.get(SGL_ENV) == "1"

    def route(self, peer: str) -> str:
        """How WRITEs to a known peer travel: "device copy (this GPU)", "device copy (peer GPU <uuid>)"
        or "NIXL"."""
        return self._routes[peer]

    def remove_peer(self, name: str) -> None:
        if self._direct is not None:
            self._direct.remove(name)
        self._routes.pop(name, None)
        self._rows = {key: rows for key, rows in self._rows.items() if key[0] != name}
        prepped = self._peer_prepped.pop(name, None)
        if prepped is not None:
            prepped.release()
        if self._peers.pop(name, None) is None:
            return
        try:
            self._open_agent().remove_remote_agent(name)
        except _NIXL_ERRORS as error:
            logger.warning("NIXL could not invalidate peer %r: %r", name, error)

    def write_pages(
        self, peer: str, src_pages: list[int], dst_pages: list[int], notif: bytes, heads: range | None = None
    ) -> TransferHandle:
        agent = self._open_agent()
        target = self._peers.get(peer)
        if target is None:
            raise KVTransferError(
                f"unknown peer {peer!r} (known: {sorted(self._peers)}): add_peer() its metadata first; "
                "remove_peer() forgets a peer after a failure"
            )
        fault = None
        if self._faults is not None:
            fault = self._faults.next_write()
            if fault == "fail_write":
                raise KVTransferError(f"injected fault ({faults.ENV}): WRITE to {peer!r} refused")
            if fault == "drop_notif":
                notif = b""  # (no notification: NIXL sends none for an empty message, nor does _poll_copy)
        if not src_pages and not dst_pages:
            # A WRITE of no pages (the peer holds the whole prompt in its prefix cache): only the
            # notification goes, the way a device copy's does once its (here empty) copy ran.
            handle = DirectHandle(peer, 0, 0, _NOTHING_TO_COPY, notif, ops=0)
            self._live.add(handle)
            return handle
        check_pages(src_pages, dst_pages, self.layout.num_pages, target.layout.num_pages)
        heads = self.layout.heads if heads is None else heads
        for side, layout in (("this", self.layout), (f"peer {peer!r}'s", target.layout)):
            if not heads or heads.start < layout.head_start or heads.stop > layout.heads.stop:
                raise ValueError(
                    f"KV heads [{heads.start}, {heads.stop}) are not all in {side} pool "
                    f"(it holds [{layout.heads.start}, {layout.heads.stop}))"
                )
        if target.verify_kv:  # (the receiver checks the pages against it before decoding them)
            checksum = self.checksum(src_pages, heads)
            if self._faults is not None and fault == "corrupt_sum":
                checksum ^= 1  # (as if a byte had changed on the way)
            notif = with_checksum(notif, checksum)
        if self._direct is not None and peer in self._direct.peers:
            handle = self._direct.write(
                peer,
                src_pages,
                dst_pages,
                _local(heads, self.layout),
                _local(heads, target.layout),
                self.layout.transfer_bytes(len(src_pages), len(heads)),
                notif,
            )
            self._live.add(handle)
            return handle
        num_bytes = self.layout.transfer_bytes(len(src_pages), len(heads))
        rows = self._rows.get((peer, heads))
        if rows is None:  # (the same for every WRITE to the peer: worked out once)
            local_heads, peer_heads = _local(heads, self.layout), _local(heads, target.layout)
            rows = self._rows[(peer, heads)] = page_rows(self.layout, local_heads, target.layout, peer_heads)
        try:
            prepped = self._peer_prepped.get(peer)
            if prepped is not None and rows[0].whole_pages:  # (NIXL merges each run into one descriptor)
                local, remote = page_indices(self.layout, src_pages), page_indices(target.layout, dst_pages)
                xfer = agent.make_prepped_xfer("WRITE", self._prepped, local, prepped, remote, notif)
                runs = 1 if one_run(src_pages, dst_pages) else len(coalesce_runs(src_pages, dst_pages))
                ops = 2 * self.layout.num_layers * runs
            else:
                runs = coalesce_runs(src_pages, dst_pages)
                xfer, ops = self._xfer_from_addresses(agent, target, rows, runs, notif)
        except _NIXL_ERRORS as error:
            raise KVTransferError(f"NIXL refused a WRITE of {len(src_pages)} pages to {peer!r}: {error!r}") from error
        handle = NixlTransferHandle(peer, len(src_pages), num_bytes, xfer, ops)
        self._live.add(handle)
        try:
            posted = agent.transfer(xfer)
        except _NIXL_ERRORS as error:
            posted = f"ERR ({error!r})"
        if posted.startswith("ERR"):
            self._release_quietly(handle)
            raise KVTransferError(f"NIXL could not post a WRITE of {len(src_pages)} pages to {peer!r}: {posted}")
        return handle

    def checksum(self, pages: list[int], heads: range | None = None) -> int:
        """The integrity checksum (integrity.py) of the model's KV `heads` (default: every head this
        pool holds) of `pages` of this pool."""
        heads = self.layout.heads if heads is None else heads
        return kv_checksum(self._views, pages, _local(heads, self.layout))

    def _xfer_from_addresses(self, agent, target: PoolMetadata, rows, runs, notif: bytes):
        """A WRITE built from descriptor lists: head slices (servers of different TP sizes), or
        pools too large for prepared lists' 32-bit indices."""
        local = run_descriptors(self._k_addrs, self._v_addrs, rows[0], self._device_id, [(s, n) for s, _, n in runs])
        remote = run_descriptors(
            target.k_addrs, target.v_addrs, rows[1], target.device_id, [(d, n) for _, d, n in runs]
        )
        local_descs, remote_descs = (
            agent.get_xfer_descs(local, self._mem_type),
            agent.get_xfer_descs(remote, target.mem_type),
        )
        return agent.initialize_xfer("WRITE", local_descs, remote_descs, target.name, notif), len(local)

    def poll(self, handle: TransferHandle) -> TransferState:
        handle = self._own(handle)
        if handle.released:
            raise KVTransferError(f"{handle} was already released")
        if isinstance(handle, DirectHandle):
            return self._poll_copy(handle)
        try:
            state = self._open_agent().check_xfer_state(handle.xfer)
        except _NIXL_ERRORS as error:
            logger.warning("WRITE to %r failed: %r", handle.peer, error)
            handle.error = f"NIXL: {error!r}"
            return TransferState.FAILED
        if state not in _XFER_STATES:
            handle.error = f"NIXL reported the WRITE {state}"
        return _XFER_STATES.get(state, TransferState.FAILED)

    def release(self, handle: TransferHandle) -> None:
        handle = self._own(handle)
        if handle.released:
            return
        if isinstance(handle, DirectHandle):
            # NOTE: a copy cannot be cancelled: wait for it (microseconds), so that pages freed
            # after this call are not read or written by it any more.
            handle.event.synchronize()
            handle.released = True
            self._live.discard(handle)
            if self._direct is not None:
                self._direct.recycle(handle)
            return
        try:
            handle.xfer.release()
        except _NIXL_ERRORS as error:
            raise KVTransferError(f"NIXL could not release (abort) {handle}: {error!r}") from error
        handle.released = True
        self._live.discard(handle)

    def _poll_copy(self, handle: DirectHandle) -> TransferState:
        """A device copy: DONE once it ran on the device and the peer was told (the notification
        a NIXL WRITE would have carried)."""
        if not handle.notified:
            if not handle.event.query():
                return TransferState.IN_PROGRESS
            try:
                if handle.notif:
                    self._open_agent().send_notif(handle.peer, handle.notif)
            except _NIXL_ERRORS as error:
                logger.warning("the notification of a copy to %r failed: %r", handle.peer, error)
                handle.error = f"its notification could not be sent: {error!r}"
                return TransferState.FAILED
            handle.notified = True
        return TransferState.DONE

    def get_notifs(self) -> list[tuple[str, bytes]]:
        received = self._open_agent().get_new_notifs()
        return [(peer, notif) for peer, notifs in received.items() for notif in notifs]

    def close(self) -> None:
        if self._agent is None:
            return
        for handle in list(self._live):
            self._release_quietly(handle)
        for prepped in [*self._peer_prepped.values(), self._prepped]:
            if prepped is not None:
                prepped.release()
        self._peer_prepped.clear()
        try:
            self._agent.deregister_memory(self._registered)
        except _NIXL_ERRORS as error:
            logger.warning("NIXL could not deregister the KV pool of %r: %r", self.name, error)
        self._peers.clear()
        self._routes.clear()
        if self._direct is not None:
            self._direct.peers.clear()
            unregister_local_pool(self.name)
        self._agent = None

    def _open_agent(self) -> nixl_agent:
        if self._agent is None:
            raise KVTransferError(f"KV transfer agent {self.name!r} is closed")
        return self._agent

    def _own(self, handle: TransferHandle) -> NixlTransferHandle | DirectHandle:
        if not isinstance(handle, (NixlTransferHandle, DirectHandle)):
            raise TypeError(f"{handle!r} is not a handle from a NixlKVAgent")
        return handle

    def _release_quietly(self, handle: NixlTransferHandle) -> None:
        try:
            self.release(handle)
        except KVTransferError as error:
            logger.warning("%s", error)


class _NothingToCopy:
    """The completed event of a copy of no pages."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


_NOTHING_TO_COPY = _NothingToCopy()


def _local(heads: range, layout) -> range:
    """The model's KV heads `heads` as indices into a pool holding layout.heads."""
    return range(heads.start - layout.head_start, heads.stop - layout.head_start)
