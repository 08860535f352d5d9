"""The router's view of its workers: discovery, health checks, load, a circuit breaker each.

Workers are given statically (HOST:PORT) or discovered: NAME:PORT is resolved every
`dns_interval` (a Kubernetes headless Service answers with one A record per ready pod), new
addresses are added — routable only once a health check says SERVING — and vanished ones removed.

Every `health_check_interval` each worker is asked `grpc.health.v1/Check` and `GetLoad`. A worker is
routable when its last check said SERVING and its circuit is not open. The circuit opens after
`circuit_failures` consecutive failed requests or checks (checks count once the worker has answered
one: before that it is starting, not failing), stays open for `circuit_open_time`, then
lets requests through again (half-open); the next success closes it, the next failure reopens it.
(The names are RouterConfig's fields.)

Each router process (`pdserve-router --workers N`) has a registry of its own: its own channels,
checks and circuits, so a server sees N times the checks, and a circuit opened by one process's
failed requests stays closed in the others until they fail too.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.common.trust import load_trust, open_channel
from pdserve.proto import pdserve_pb2 as pb
from pdserve.proto import pdserve_pb2_grpc as pb_grpc
from pdserve.router.config import RouterConfig, name_port
from pdserve.router.loop_lag import LoopLag
from pdserve.router.policies import WorkerView

log = logging.getLogger(__name__)

STARTING_CHECK_S = 0.1  # how often a starting worker is checked (Worker.starting)
STARTING_WINDOW_S = 600.0  # ... for at most this long after it was added (then: --health-check-interval)


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
    seen: bool = False  # a check has answered: until then it is starting, and failed checks are not failures
    errors: int = 0  # total, for /metrics
    ever_served: bool = False  # a check has said SERVING once
    added_at: float = 0.0  # time.monotonic() when the registry took it

    def starting(self, now: float) -> bool:
        """Not yet SERVING once, and added less than STARTING_WINDOW_S ago: checked every
        STARTING_CHECK_S, so that a server is routable within a tenth of a second of its model being
        loaded rather than up to a health-check interval later."""
        return not self.ever_served and now - self.added_at < STARTING_WINDOW_S

    def routable(self, now: float) -> bool:
        return self.serving and now >= self.open_until

    def view(self, now: float) -> WorkerView:
        return WorkerView(self.url, self.routable(now), self.load, self.inflight)


def resolve_dns(name: str, port: int) -> set[str]:
    """HOST:PORT for every IPv4/IPv6 address `name` resolves to (empty when it does not resolve)."""
    try:
        infos = socket.getaddrinfo(name, port, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return set()
    return {f"[{a[0]}]:{a[1]}" if ":" in a[0] else f"{a[0]}:{a[1]}" for *_, a in infos}


class WorkerRegistry:
    def __init__(
        self,
        config: RouterConfig,
        resolve=resolve_dns,
        on_removed=None,
        loop_lag: LoopLag | None = None,
        on_unresponsive=None,
    ):
        """`on_unresponsive(role, url)`: after each failed check once a worker's checks have failed
        `circuit_failures` times in a row (a hung or dead server)."""
        self.config = config
        self.loop_lag = loop_lag  # this process's event loop's lateness: a probe it delayed is no evidence
        self.urls = {"prefill": config.prefill, "decode": config.decode}
        self.dns = {
            "prefill": [name_port(d) for d in config.prefill_dns],
            "decode": [name_port(d) for d in config.decode_dns],
        }
        self.resolve = resolve
        self.on_removed = on_removed or (lambda role, url: None)
        self.on_unresponsive = on_unresponsive or (lambda role, url: None)
        self.trust = load_trust(config)  # every channel carries the cluster secret (and TLS) from it
        self.workers: dict[str, Worker] = {}
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        """Create the channels (on the running loop) and run one round of checks before serving."""
        for role, urls in self.urls.items():
            for url in urls:
                self._add(role, url)
        await self.discover()
        await self.check_all()
        self._tasks = [asyncio.create_task(self._check_forever())]
        if any(self.dns.values()):
            self._tasks.append(asyncio.create_task(self._discover_forever()))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for w in self.workers.values():
            await w.channel.close()

    async def discover(self) -> None:
        """Add the addresses the DNS names resolve to now; remove discovered ones that vanished."""
        for role, names in self.dns.items():
            if not names:
                continue
            found: dict[str, str] = {}  # url -> the name it was found under (its TLS server name)
            for name, port in names:
                found |= dict.fromkeys(await asyncio.to_thread(self.resolve, name, port), name)
            static = set(self.urls[role])
            for url in found.keys() - set(w.url for w in self.of(role)):
                log.info("discovered %s %s", role, url)
                self._add(role, url, server_name=found[url])
            for w in [w for w in self.of(role) if w.url not in found and w.url not in static]:
                log.info("%s %s left", role, w.url)
                del self.workers[w.url]
                self.on_removed(role, w.url)
                await w.channel.close()  # in-flight calls on it fail and are retried elsewhere

    def _add(self, role: str, url: str, server_name: str = "") -> None:
        self.workers[url] = Worker(url, role, open_channel(url, self.trust, server_name), added_at=time.monotonic())

    async def _discover_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.dns_interval)
            await self.discover()
            await self.check_all()

    def of(self, role: str) -> list[Worker]:
        return [w for w in self.workers.values() if w.role == role]

    def views(self, role: str) -> list[WorkerView]:
        now = time.monotonic()
        return [w.view(now) for w in self.of(role)]

    def record(self, url: str, ok: bool) -> None:
        """A request's outcome on `url`: feeds the circuit breaker."""
        w, limit = self.workers[url], self.config.circuit_failures
        if ok:
            if w.failures >= limit:
                log.info("circuit closed for %s", url)
            w.failures, w.open_until = 0, 0.0
            return
        w.failures += 1
        w.errors += 1
        if w.failures >= limit:
            w.open_until = time.monotonic() + self.config.circuit_open_time
            # Once per outage: a worker that stays down (or is still starting) fails every check.
            if w.failures == limit:
                log.warning("circuit open for %s after %d failures", url, w.failures)

    async def check_all(self) -> None:
        await asyncio.gather(*(self._check(w) for w in list(self.workers.values())))

    def _loop_was_late(self, error: grpc.aio.AioRpcError, sent: float, timeout: float) -> bool:
        """A probe that timed out while this process's own loop stalled for half its timeout or more
        (a request held it) says nothing about the server: its answer may have come and waited."""
        late = self.loop_lag is not None and self.loop_lag.worst_since(sent) >= timeout / 2
        return error.code() == grpc.StatusCode.DEADLINE_EXCEEDED and late

    async def _check_forever(self) -> None:
        """Every worker each --health-check-interval; a starting one (Worker.starting) also every
        STARTING_CHECK_S in between. Only a starting worker is checked early, and an early check's failure
        is not counted: circuits keep the pace --health-check-interval and --circuit-failures set."""
        next_all = time.monotonic() + self.config.health_check_interval
        while True:
            now = time.monotonic()
            starting = [w for w in self.workers.values() if w.starting(now)]
            await asyncio.sleep(
                min(STARTING_CHECK_S, max(0.0, next_all - now)) if starting else max(0.0, next_all - now)
            )
            if time.monotonic() >= next_all:
                next_all = time.monotonic() + self.config.health_check_interval
                await self.check_all()
            else:
                await asyncio.gather(*(self._check(w, early=True) for w in starting if w.url in self.workers))

    async def _check(self, w: Worker, early: bool = False) -> None:
        """`early`: a starting worker's check between two intervals: its failure is not counted (the
        interval's checks alone pace circuits and the unresponsive callback)."""
        timeout = self.config.health_check_timeout
        sent = time.monotonic()
        try:
            reply = await health_pb2_grpc.HealthStub(w.channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
            stub = pb_grpc.DecodeServiceStub(w.channel) if w.role == "decode" else pb_grpc.PrefillServiceStub(w.channel)
            load = await stub.GetLoad(pb.GetLoadRequest(), timeout=timeout)
        except grpc.aio.AioRpcError as e:
            if self._loop_was_late(e, sent, timeout):
                log.info("%s %s: a health check timed out while this router's loop was late: no result", w.role, w.url)
                return
            if w.serving:
                log.warning("%s %s failed its health check", w.role, w.url)
            w.serving = False
            if w.seen and not early:  # (never seen: a server still starting, e.g. under `pdserve up`)
                self.record(w.url, ok=False)
                if w.failures >= self.config.circuit_failures:
                    self.on_unresponsive(w.role, w.url)
            return
        w.seen = True
        w.serving = reply.status == health_pb2.HealthCheckResponse.SERVING
        w.ever_served = w.ever_served or w.serving
        w.load = load.running_requests + load.waiting_requests
