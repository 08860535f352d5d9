"""Which KV has landed for each room, over every TP rank of this decode server.

A prefill server of any TP size WRITEs each decode rank's heads from whichever of its ranks hold
them (common/kv_transfer/tp_plan.py); every WRITE carries its own notification to the decode rank
it lands on (room, first token, pages, bytes, the heads it moved). Rank 0 sees them all: its own
agent's, and the other ranks' forwarded as they arrive (common/kv_transfer/rank_duty.py
ReceiverDuty). A room is complete once every rank's heads have landed; only then does the
request join the running batch.

Why notifications are not sent to rank 0's agent directly: a NIXL notification rides with the
WRITE it reports and is delivered after that WRITE's data, on the agent the data lands on; one
sent separately would say nothing about a WRITE into another process's memory. So each rank
reports what its own agent saw.

Each notification is checked on its own against the grant (malformed, unknown_room, page_count,
head_range, byte_count: ipc.REJECT_REASONS); anyone who reaches a rank's UCX port can send one.
With --kv-integrity-check an accepted WRITE is landed but unverified until the rank it landed on
has summed its pages (decode/kv_checks.py); only then do its heads count (`land`).
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.common.kv_transfer import KVLayout, decode_notif
from pdserve.common.types import TokenLogprob


class Refused(Exception):
    """A KV notification that matches no grant: why (ipc.REJECT_REASONS) and the details."""

    def __init__(self, reason: str, detail: str):
        super().__init__(reason)
        self.reason, self.detail = reason, detail


@dataclass(frozen=True)
class Landing:
    """One WRITE that landed on `rank` for a room still waiting, as its notification says."""

    rank: int
    room: int
    heads: range  # the model's KV heads it moved
    pages: int
    first_token: int
    logprob: TokenLogprob | None
    checksum: int | None  # the sender's (integrity.py), where this server asked for one


class KVArrivals:
    def __init__(self, rank_layouts: list[KVLayout], vocab_size: int):
        self.layouts, self.vocab_size = rank_layouts, vocab_size
        self.partial: dict[int, list[set[int]]] = {}  # room -> heads landed, per rank (incomplete rooms)

    def accept(self, rank: int, message: bytes, granted_pages, waiting) -> Landing | None:
        """The WRITE `message` (received by `rank`'s agent) reports; None for a late copy (a room
        no longer `waiting`: a retried prefill's, ignored). Raises Refused for one matching no grant.

        granted_pages(room): pages granted for the room, None if none; waiting(room): whether
        the room still waits for its KV."""
        try:
            notif = decode_notif(message)
            lp = notif["logprobs"]
            logprob = (
                TokenLogprob(int(lp["token_id"]), float(lp["logprob"]), [(int(t), float(v)) for t, v in lp["top"]])
                if lp
                else None
            )
        except (ValueError, KeyError, TypeError) as e:
            raise Refused("malformed", str(e)[:120]) from None
        room, token = notif["room"], notif["first_token"]
        if token >= self.vocab_size:
            raise Refused("malformed", f"first token {token} outside the vocabulary (room {room})")
        pages = granted_pages(room)
        if pages is None:
            raise Refused("unknown_room", f"room {room} was not granted")
        if notif["pages"] != pages:
            raise Refused("page_count", f"{notif['pages']} pages for room {room}, granted {pages}")
        layout = self.layouts[rank]
        heads = notif["heads"] if notif["heads"] is not None else layout.heads
        if heads.start < layout.head_start or heads.stop > layout.heads.stop:
            raise Refused(
                "head_range",
                f"KV heads [{heads.start}, {heads.stop}) for room {room} at TP rank {rank}, "
                f"which holds [{layout.heads.start}, {layout.heads.stop})",
            )
        if notif["bytes"] != layout.transfer_bytes(pages, len(heads)):
            raise Refused(
                "byte_count",
                f"{notif['bytes']} bytes for room {room} at TP rank {rank}, granted "
                f"{layout.transfer_bytes(pages, len(heads))}",
            )
        if not waiting(room):
            return None
        return Landing(rank, room, heads, pages, token, logprob, notif["sum"])

    def land(self, landing: Landing) -> tuple[int, int, TokenLogprob | None] | None:
        """Count the heads of an accepted (and, with the check on, verified) WRITE: (room, first
        token, its logprob) when they complete the room, else None (other WRITEs are missing)."""
        landed = self.partial.setdefault(landing.room, [set() for _ in self.layouts])
        landed[landing.rank].update(landing.heads)
        if any(len(got) < layout.kv_heads for got, layout in zip(landed, self.layouts)):
            return None
        del self.partial[landing.room]
        return landing.room, landing.first_token, landing.logprob

    def forget(self, waiting) -> None:
        """Drop the incomplete rooms that no longer wait (expired or aborted and freed)."""
        for room in [room for room in self.partial if not waiting(room)]:
            del self.partial[room]
