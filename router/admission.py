"""The router's admission: how many choices run on the servers at once, and who waits for a turn.

Every choice (a prompt x n of a request) is a request on a prefill and a decode server. A router
process runs at most `--max-inflight` of them at once. A request takes as many of these slots as
it runs choices at once — all of them, or `--max-choices-at-once` for a request of many — holds
them until it is answered, and runs its choices through them in turn. A request that finds no free
slots waits in one FIFO queue with the others: at most `--max-queued` requests wait, each at most
`--queue-timeout` seconds; beyond either it is told 429 with Retry-After. So one client's fan-out
waits its turn like everyone else's requests, and overload is a queue or a 429, never a pile of
requests on the servers that time out there (and then look like the servers' failures).

The queue is strict FIFO: a request wanting many slots at the head is not overtaken by smaller
ones behind it (it would starve), and takes its slots as soon as that many are free.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field


class Overloaded(Exception):
    """No slots for the request: the queue is full, or its turn did not come in time."""


@dataclass
class _Waiter:
    slots: int
    granted: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class Admission:
    """Choice slots of one router process, and the FIFO queue of requests waiting for them."""

    def __init__(self, slots: int, max_queued: int, queue_timeout: float):
        self.slots, self.max_queued, self.queue_timeout = slots, max_queued, queue_timeout
        self.used = 0
        self.queue: deque[_Waiter] = deque()

    @property
    def queued(self) -> int:
        return len(self.queue)

    async def acquire(self, slots: int) -> int:
        """Wait for `slots` slots (at most all of them) in FIFO order; return how many were taken.
        Raises Overloaded when the queue is full or the wait passes the queue timeout. The caller
        must `release` what it took."""
        slots = max(1, min(slots, self.slots))
        if not self.queue and self.used + slots <= self.slots:
            self.used += slots
            return slots
        if len(self.queue) >= self.max_queued:
            raise Overloaded(
                f"the router's queue is full ({self.max_queued} requests wait for {self.slots} choice slots, all taken)"
            )
        waiter = _Waiter(slots)
        self.queue.append(waiter)
        # NOTE: a timer, not asyncio.wait_for: wait_for returns the result of a future that completed
        # as the task was being cancelled, swallowing the cancellation, and a caller that gave up
        # (the client gone) would never release the slots it did not know it had.
        timer = asyncio.get_running_loop().call_later(self.queue_timeout, self._expire, waiter)
        try:
            await waiter.granted
        except BaseException:  # timed out (Overloaded), or cancelled: the client is gone
            if waiter.granted.done() and not waiter.granted.cancelled() and waiter.granted.exception() is None:
                self.release(slots)  # granted just as it gave up: the slots are its, hand them back
            elif waiter in self.queue:
                self.queue.remove(waiter)
                self._grant()  # it may have held up smaller requests behind it
            raise
        finally:
            timer.cancel()
        return slots

    def release(self, slots: int) -> None:
        self.used -= slots
        self._grant()

    def _expire(self, waiter: _Waiter) -> None:
        if waiter.granted.done():
            return
        self.queue.remove(waiter)
        waiter.granted.set_exception(
            Overloaded(
                f"no choice slot became free in {self.queue_timeout:g} s (the router's --queue-timeout); "
                f"the servers are busy"
            )
        )
        self._grant()

    def _grant(self) -> None:
        while self.queue and self.used + self.queue[0].slots <= self.slots:
            waiter = self.queue.popleft()
            if waiter.granted.done():  # cancelled, its task not yet run to leave the queue
                continue
            self.used += waiter.slots
            waiter.granted.set_result(None)
