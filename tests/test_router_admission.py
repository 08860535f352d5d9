"""The router's admission (router/admission.py): choice slots, a strict FIFO queue, its bound and
its deadline, and slots never leaked by a request that gives up (timeout, client gone)."""

from __future__ import annotations

import asyncio
import time

import pytest

from pdserve.router.admission import Admission, Overloaded


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_requests_within_the_slots_start_at_once_and_a_large_one_is_capped():
    async def main():
        admission = Admission(slots=4, max_queued=0, queue_timeout=1)
        assert await admission.acquire(3) == 3
        assert await admission.acquire(1) == 1
        with pytest.raises(Overloaded, match="queue is full"):  # no queue: 429 at once
            await admission.acquire(1)
        admission.release(4)
        assert await admission.acquire(100) == 4  # at most every slot

    run(main())


def test_the_queue_is_strict_fifo_and_a_release_grants_in_order():
    async def main():
        admission = Admission(slots=2, max_queued=10, queue_timeout=5)
        await admission.acquire(2)
        granted = []

        async def request(name, slots):
            taken = await admission.acquire(slots)
            granted.append(name)
            return taken

        big = asyncio.create_task(request("big", 2))
        await settle()
        small = asyncio.create_task(request("small", 1))
        await settle()
        assert admission.queued == 2 and granted == []
        admission.release(1)  # one free slot: the small one behind must not overtake the big one
        await settle()
        assert granted == []
        admission.release(1)
        await settle()
        assert granted == ["big"] and admission.queued == 1
        admission.release(await big)
        await settle()
        assert granted == ["big", "small"] and admission.used == 1 and admission.queued == 0
        await small

    run(main())


def test_a_full_queue_says_overloaded_at_once():
    async def main():
        admission = Admission(slots=1, max_queued=1, queue_timeout=5)
        await admission.acquire(1)
        waiting = asyncio.create_task(admission.acquire(1))
        await settle()
        started = time.monotonic()
        with pytest.raises(Overloaded, match="queue is full"):
            await admission.acquire(1)
        assert time.monotonic() - started < 0.5
        waiting.cancel()

    run(main())


def test_a_request_whose_turn_does_not_come_in_time_leaves_the_queue():
    async def main():
        admission = Admission(slots=1, max_queued=5, queue_timeout=0.3)
        await admission.acquire(1)
        started = time.monotonic()
        with pytest.raises(Overloaded, match="--queue-timeout"):
            await admission.acquire(1)
        assert time.monotonic() - started >= 0.3
        assert admission.queued == 0
        admission.release(1)
        assert admission.used == 0  # nobody was granted the slot on its behalf

    run(main())


def test_a_waiter_that_leaves_lets_the_ones_behind_it_in():
    async def main():
        admission = Admission(slots=2, max_queued=5, queue_timeout=5)
        await admission.acquire(1)
        big = asyncio.create_task(admission.acquire(2))  # needs both: waits
        await settle()
        small = asyncio.create_task(admission.acquire(1))  # fits, but queued behind the big one
        await settle()
        assert not small.done()
        big.cancel()  # its client went away
        assert await asyncio.wait_for(small, 1) == 1 and admission.used == 2 and admission.queued == 0

    run(main())


def test_a_waiter_cancelled_just_after_its_grant_hands_the_slots_back():
    async def main():
        admission = Admission(slots=1, max_queued=5, queue_timeout=5)
        await admission.acquire(1)
        waiter = asyncio.create_task(admission.acquire(1))
        await settle()
        admission.release(1)  # grants the waiter (its future is set) ...
        waiter.cancel()  # ... and its client leaves before it runs again
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert admission.used == 0 and admission.queued == 0

    run(main())
