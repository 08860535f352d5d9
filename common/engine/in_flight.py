"""The launched batches whose results are not processed yet: the overlapped loop's one queue.

    in_flight.push(batch, result)        launch N: its forward (and sampling) are queued on the device
    in_flight.take_before(batch)         N-1, N-2, ... in launch order, each removed as it is taken
    in_flight.oldest()                   the next to be processed (its deferred sampling waits on masks)
    in_flight.last_batch()               the newest launched batch (must the next one run serially?)
    in_flight.map_results(fn)            swap results in place (a deferred sampling, once launched)

The order is the loop's correctness (docs/architecture.md, "The overlapped loop"): results are
processed in launch order, one step late, and at most two batches are in flight in the overlapped
loop (N running, N-1 being processed). EngineCore owns the only instance; the loops reach it
through EngineCore.launch and EngineCore.process_results_before, never as a list.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Iterator


class InFlight:
    """Launched (batch, result) pairs, oldest first."""

    def __init__(self):
        self._entries: deque[list] = deque()  # [batch, result]: the result may be swapped (map_results)

    def __bool__(self) -> bool:
        return bool(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def push(self, batch, result) -> None:
        self._entries.append([batch, result])

    def take_before(self, batch) -> Iterator[tuple]:
        """Every entry launched before `batch` (all of them when `batch` is None or not in flight),
        oldest first. NOTE: each is removed only as it is taken, so while the caller processes one,
        oldest() is already the next: a deferred sampling that waits on this result's tokens."""
        while self._entries and self._entries[0][0] is not batch:
            batch_, result = self._entries.popleft()
            yield batch_, result

    def oldest(self) -> tuple | None:
        return tuple(self._entries[0]) if self._entries else None

    def last_batch(self):
        return self._entries[-1][0] if self._entries else None

    def map_results(self, fn: Callable) -> None:
        """result = fn(batch, result) for every entry, oldest first."""
        for entry in self._entries:
            entry[1] = fn(entry[0], entry[1])
