"""How late this router process's event loop runs: a timer asks to wake every PERIOD_S and notes
how much later than asked it did. Every request, health probe and stream of the process waits on
that loop, so its lag is theirs too.

Uses: the `pdserve_router_event_loop_lag_seconds` gauge (router/metrics.py: the worst lag of the
last GAUGE_WINDOW_S), a warning once per WARN_EVERY_S while the loop is later than WARN_S, and the
health checks (router/workers.py), which count a probe that timed out while the loop itself was
late as no result, not as the server's failure.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque

log = logging.getLogger(__name__)

PERIOD_S = 0.05
WARN_S = 0.5  # a lag past this is logged: some request held the loop
WARN_EVERY_S = 10.0
KEEP_S = 120.0  # lags older than this are forgotten
GAUGE_WINDOW_S = 10.0


class LoopLag:
    def __init__(self, period_s: float = PERIOD_S):
        self.period_s = period_s
        self.lags: deque[tuple[float, float]] = deque()  # (when it was seen, lag), lags > 1 ms only
        self.last_tick = time.monotonic()
        self._warned = 0.0
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self.last_tick = time.monotonic()
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.period_s)
            self.tick(time.monotonic())

    def tick(self, now: float) -> None:
        lag = max(0.0, now - self.last_tick - self.period_s)
        self.last_tick = now
        if lag > 0.001:
            self.lags.append((now, lag))
        while self.lags and self.lags[0][0] < now - KEEP_S:
            self.lags.popleft()
        if lag > WARN_S and now - self._warned > WARN_EVERY_S:
            self._warned = now
            log.warning("the router's event loop ran %.0f ms late: something held it", lag * 1e3)

    def current(self, now: float) -> float:
        """How late the timer is right now (the loop may be catching up from a stall that has not ended in
        a tick yet)."""
        return max(0.0, now - self.last_tick - self.period_s)

    def worst_since(self, start: float, now: float | None = None) -> float:
        """The worst lag seen since `start` (monotonic seconds), the one in progress included."""
        now = time.monotonic() if now is None else now
        worst = self.current(now)
        for seen, lag in reversed(self.lags):
            # a lag seen at `seen` covers [seen - lag, seen]: it counts if that overlaps [start, now]
            if seen < start:
                break
            worst = max(worst, lag)
        return worst
