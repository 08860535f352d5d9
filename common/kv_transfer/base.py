"""The KV transfer contract: one agent per KV pool, page-granular one-sided WRITEs into a peer's pool.

Roles: the decode side publishes `metadata()`; the prefill side `add_peer(metadata)`s it and then
`write_pages(...)` straight into the decode pool, with a notification that the decode side picks
up from `get_notifs()` once the data has landed. The decode side never needs the prefill side's
metadata.

An agent is driven by one thread at a time (no internal locking).
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pdserve.common.engine.kv_pool import PagedKVPool

if TYPE_CHECKING:
    from pdserve.common.kv_transfer.pool_metadata import PoolMetadata


class KVTransferError(RuntimeError):
    """A transfer could not be started, or an agent or peer was used in a state that forbids it."""


class KVSide(str, enum.Enum):
    """A server's side of every KV transfer (a str: it travels to TP ranks as JSON)."""

    SENDER = "sender"  # a prefill server: its ranks WRITE the prompt's pages
    RECEIVER = "receiver"  # a decode server: its ranks receive them and hand the notifications on


class TransferState(enum.Enum):
    DONE = "done"
    IN_PROGRESS = "in_progress"
    FAILED = "failed"


# The layout fields that must be equal on both sides for a head's page to mean the same bytes.
# kv_heads may differ: with tensor parallelism each rank's pool holds a slice of the model's KV
# heads, and a transfer between pools moves the heads both hold.
_MATCHING_FIELDS = ("page_size", "dtype", "num_layers", "head_dim", "model_kv_heads")


@dataclass(frozen=True)
class KVLayout:
    """The shape of a PagedKVPool, as far as a transfer into or out of it is concerned.

    `dtype` is the torch dtype name without the "torch." prefix ("float32", "bfloat16"). The pool
    holds the model's KV heads [head_start, head_start + kv_heads) of `model_kv_heads` (0: the
    pool holds them all). Memory is token-major per layer (common/engine/kv_pool.py): page p is
    page_bytes contiguous bytes at p * page_bytes, its token t's head h (local) head_dim elements
    at (t * kv_heads + h) * head_dim of them (pages.page_rows).
    """

    page_size: int
    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    num_pages: int
    head_start: int = 0
    model_kv_heads: int = 0

    def __post_init__(self):
        if not self.model_kv_heads:
            object.__setattr__(self, "model_kv_heads", self.kv_heads)

    @classmethod
    def of_pool(cls, pool: PagedKVPool) -> KVLayout:
        return cls(
            page_size=pool.page_size,
            num_layers=pool.num_layers,
            kv_heads=pool.kv_heads,
            head_dim=pool.head_dim,
            dtype=str(pool.dtype).removeprefix("torch."),
            num_pages=pool.num_pages,
            head_start=pool.head_start,
            model_kv_heads=pool.model_kv_heads,
        )

    @property
    def heads(self) -> range:
        """The model's KV heads this pool holds."""
        return range(self.head_start, self.head_start + self.kv_heads)

    @property
    def head_page_bytes(self) -> int:
        """Bytes of one page of one head of one layer's K (or V) buffer (page_size rows of head_dim)."""
        return self.page_size * self.head_dim * getattr(torch, self.dtype).itemsize

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of one layer's K (or V) buffer, every head of the pool: contiguous."""
        return self.kv_heads * self.head_page_bytes

    def transfer_bytes(self, num_pages: int, num_heads: int | None = None) -> int:
        """Bytes a WRITE of `num_pages` pages moves: every layer's K and V page, of `num_heads`
        heads (default: all the pool's)."""
        heads = self.kv_heads if num_heads is None else num_heads
        return 2 * self.num_layers * num_pages * heads * self.head_page_bytes

    def compatible_with(self, other: KVLayout) -> str | None:
        """None when a head's pages can be copied between the two pools byte for byte, else why not.

        num_pages and the heads held may differ: each side validates page ids and head ranges
        against its own pool.
        """
        mismatches = [
            f"{field} {getattr(self, field)} here vs {getattr(other, field)} at the peer"
            for field in _MATCHING_FIELDS
            if getattr(self, field) != getattr(other, field)
        ]
        if self.dtype != other.dtype:  # the one a flag decides on each server
            mismatches.append("both servers need the same --dtype and --kv-cache-dtype")
        return "; ".join(mismatches) if mismatches else None


class TransferHandle:
    """One posted WRITE. Opaque beyond these fields; poll it, then release it."""

    path = "nixl"  # how its pages travel (spans' pdserve.kv_transfer.path): NIXL, or direct.py's device copy

    def __init__(self, peer: str, num_pages: int, num_bytes: int, ops: int = 0):
        self.peer = peer
        self.num_pages = num_pages
        self.num_bytes = num_bytes
        self.ops = ops  # what it posted: NIXL descriptors, or kernel launches for a device copy
        self.error: str | None = None  # why it failed, where the agent knows more than FAILED

    def __repr__(self) -> str:
        return f"{type(self).__name__}(peer={self.peer!r}, num_pages={self.num_pages}, num_bytes={self.num_bytes})"


class KVTransferAgent(ABC):
    """A transfer endpoint owning one KV pool, registered once for its whole lifetime.

    The pool's K/V tensors must not be reallocated while the agent lives: peers write to the
    addresses published by `metadata()`.
    """

    name: str
    layout: KVLayout

    @abstractmethod
    def metadata(self) -> PoolMetadata:
        """Everything a peer needs to WRITE into this agent's pool (transport metadata, layout,
        per-layer K/V base addresses); `pool_metadata.encode_pool_metadata` puts a server's ranks'
        on the wire (versioned, no pickle). Stable for the agent's lifetime."""

    @abstractmethod
    def add_peer(self, metadata: PoolMetadata) -> str:
        """Load a peer's `metadata()` and return its name.

        Adding the same metadata again is a no-op. Metadata under a known name but with different
        content (the peer restarted) replaces the old entry, which fails transfers still in flight
        to the old one. Raises ValueError, with the reason, for undecodable metadata or a layout
        this pool's pages cannot be copied into.
        """

    @abstractmethod
    def remove_peer(self, name: str) -> None:
        """Forget a peer (after a failure); later writes to it raise KVTransferError until it is
        added again. Unknown names are ignored."""

    @abstractmethod
    def write_pages(
        self, peer: str, src_pages: list[int], dst_pages: list[int], notif: bytes, heads: range | None = None
    ) -> TransferHandle:
        """Post a WRITE of every layer's K and V of local `src_pages` into the peer's `dst_pages`
        (pairwise, same order) and return at once: the model's KV heads `heads` (default: all of
        this pool's), which both pools must hold.

        Runs that are contiguous on both sides go as one descriptor per layer per K/V per head.
        `notif` is delivered to the peer's `get_notifs()` after all the data has landed (b""
        sends none). Raises ValueError for bad page lists (page 0, out of range, unequal lengths,
        empty, repeated destinations) or heads a pool lacks, and KVTransferError for an unknown
        peer or a refused post.
        """

    @abstractmethod
    def poll(self, handle: TransferHandle) -> TransferState:
        """The handle's state; never blocks, never raises for transport errors (FAILED instead)."""

    @abstractmethod
    def release(self, handle: TransferHandle) -> None:
        """Free the handle, once poll() said DONE or FAILED. Releasing one still IN_PROGRESS asks
        the transport to abort it and raises KVTransferError if it cannot. Idempotent."""

    @abstractmethod
    def get_notifs(self) -> list[tuple[str, bytes]]:
        """(peer name, notif) pairs received since the last call, oldest first per peer; never
        blocks."""

    @abstractmethod
    def close(self) -> None:
        """Release outstanding handles and unregister the pool. Idempotent; nothing else may be
        called afterwards."""
