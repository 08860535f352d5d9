"""The router's view of its workers: health checks, load, and a circuit breaker per worker.

Every `CHECK_INTERVAL_S` each worker is asked `grpc.health.v1/Check` and `GetLoad`. A worker is
routable when its last check said SERVING and its circuit is not open. The circuit opens after
`FAILURES_TO_OPEN` consecutive failed requests or checks, stays open for `OPEN_S`, then lets
requests through again (half-open); the next success closes it, the next failure reopens it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.proto import pdserve_pb2 as pb
from pdserve.proto import pdserve_pb2_grpc as pb_grpc
from pdserve.router.policies import WorkerView

log = logging.getLogger(__name__)

CHECK_INTERVAL_S = 1.0
FAILURES_TO_OPEN = 3
OPEN_S = 5.0


@dataclass
class Worker:
    url: str
    role: str  # "prefill" | "decode"
    channel: grpc.aio.Channel
    serving: bool = False
    load: int = 0
    inflight: int = 0
    failures: int = 0  # consecutive
    open_until: float = 0.0
    errors: int = 0  # total, for /metrics

    def routable(self, now: float) -> bool:
        return self.serving and now >= self.open_until

    def view(self, now: float) -> WorkerView:
        return WorkerView(self.url, self.routable(now), self.load, self.inflight)


class WorkerRegistry:
    def __init__(self, prefill: tuple[str, ...], decode: tuple[str, ...]):
        self.urls = {"prefill": prefill, "decode": decode}
        self.workers: dict[str, Worker] = {}
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        """Create the channels (on the running loop) and run one round of checks before serving."""
        for role, urls in self.urls.items():
            for url in urls:
                self.workers[url] = Worker(url, role, grpc.aio.insecure_channel(url))
        await self.check_all()
        self._task = asyncio.create_task(self._check_forever())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for w in self.workers.values():
            await w.channel.close()

    def of(self, role: str) -> list[Worker]:
        return [w for w in self.workers.values() if w.role == role]

    def views(self, role: str) -> list[WorkerView]:
        now = time.monotonic()
        return [w.view(now) for w in self.of(role)]

    def record(self, url: str, ok: bool) -> None:
        """A request's outcome on `url`: feeds the circuit breaker."""
        w = self.workers[url]
        if ok:
            w.failures, w.open_until = 0, 0.0
            return
        w.failures += 1
        w.errors += 1
        if w.failures >= FAILURES_TO_OPEN:
            w.open_until = time.monotonic() + OPEN_S
            log.warning("circuit open for %s after %d failures", url, w.failures)

    async def check_all(self) -> None:
        await asyncio.gather(*(self._check(w) for w in self.workers.values()))

    async def _check_forever(self) -> None:
        while True:
            await asyncio.sleep(CHECK_INTERVAL_S)
            await self.check_all()

    async def _check(self, w: Worker) -> None:
        try:
            reply = await health_pb2_grpc.HealthStub(w.channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
            stub = pb_grpc.DecodeServiceStub(w.channel) if w.role == "decode" else pb_grpc.PrefillServiceStub(w.channel)
            load = await stub.GetLoad(pb.GetLoadRequest(), timeout=2)
        except grpc.aio.AioRpcError:
            if w.serving:
                log.warning("%s %s failed its health check", w.role, w.url)
            w.serving = False
            self.record(w.url, ok=False)
            return
        w.serving = reply.status == health_pb2.HealthCheckResponse.SERVING
        w.load = load.running_requests + load.waiting_requests
