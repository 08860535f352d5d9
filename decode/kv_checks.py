"""The KV integrity check of a decode server (--kv-integrity-check; the sum: common/kv_transfer/integrity.py):
each WRITE's pages, summed on the TP rank they landed on, against the checksum its sender computed.

    checks.submit(landing, peer)    a WRITE accepted against its grant (decode/arrivals.py): landed,
                                    not yet verified
    checks.done(waiting)            the WRITEs checked since: (landing, sender, None or why not)

A WRITE into rank 0's pool is summed at once. One into rank r's pool can be read only by rank r:
rank 0 sends it CheckKV (the room's pages, the WRITE's heads) and rank r answers KVSum
(common/kv_transfer/rank_duty.py ReceiverDuty), a few steps later. The sum covers exactly the heads
and pages that landed in that rank's shard, as the sender rank's covered what it moved, so the two
agree whatever the two servers' TP sizes. Meanwhile the WRITE's heads do not count: the room joins
a batch only once every rank's WRITEs have passed (KVArrivals.land).

NOTE (no unbounded wait): an answer that never comes leaves its room waiting, and the room fails at
--kv-transfer-timeout like a lost notification (DecodeScheduler.expire_transfers); an answer for a
room that no longer waits (expired, aborted, failed by another rank's check) is dropped, and so are
the questions about it (`forget`).
"""

from __future__ import annotations

import itertools

from pdserve.common.engine.tp_messages import CheckKV, KVSum
from pdserve.decode.arrivals import Landing


class KVChecks:
    def __init__(self, agent, tp_workers, received_pages):
        """`agent`: rank 0's (its pool); `tp_workers`: the other ranks (None with TP 1);
        `received_pages(room)`: the pages a WRITE for a waiting room lands in (DecodeScheduler)."""
        self.agent, self.tp_workers, self.received_pages = agent, tp_workers, received_pages
        self.asked: dict[int, tuple[Landing, str]] = {}  # CheckKV id -> the WRITE on another rank, its sender
        self.checked: list[tuple[Landing, str, str | None]] = []  # not yet taken by done()
        self._ids = itertools.count()

    def submit(self, landing: Landing, peer: str) -> None:
        """Check the WRITE `landing` reports (from agent `peer`), now on rank 0, later on another rank."""
        if not landing.pages:  # (the decode server held the whole prompt: only the notification came)
            self.checked.append((landing, peer, None))
            return
        if landing.checksum is None:
            self.checked.append((landing, peer, "the notification carries no checksum"))
            return
        pages = self.received_pages(landing.room)
        if landing.rank == 0:
            self.checked.append((landing, peer, _mismatch(landing, self.agent.checksum(pages, landing.heads))))
            return
        id = next(self._ids)
        self.asked[id] = (landing, peer)
        heads = landing.heads
        self.tp_workers.send_to(landing.rank, CheckKV(id, pages, heads.start, heads.stop))

    def done(self, waiting) -> list[tuple[Landing, str, str | None]]:
        """The WRITEs checked since the last call whose rooms still wait: (landing, sender, None if
        its pages are the sender's, else why not)."""
        if self.tp_workers is not None:
            for answer in self.tp_workers.take(KVSum):
                asked = self.asked.pop(answer.id, None)
                if asked is not None:  # (else forgotten: its room stopped waiting)
                    landing, peer = asked
                    self.checked.append((landing, peer, _mismatch(landing, answer.sum)))
        checked, self.checked = self.checked, []
        return [c for c in checked if waiting(c[0].room)]

    def forget(self, waiting) -> None:
        """Drop the questions about rooms that no longer wait (their answers are ignored)."""
        for id in [id for id, (landing, _) in self.asked.items() if not waiting(landing.room)]:
            del self.asked[id]


def _mismatch(landing: Landing, got: int) -> str | None:
    if got == landing.checksum:
        return None
    where = f" on TP rank {landing.rank}" if landing.rank else ""
    return f"the pages that landed{where} sum to {got:#010x}, the sender's to {landing.checksum:#010x}"
