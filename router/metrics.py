"""The router's Prometheus series, served on /metrics — by one process, or summed over all of them.

With `--workers N` every worker sets PROMETHEUS_MULTIPROC_DIR (router/metrics_env.py) to a fresh
directory the supervisor made (router/serve.py's run_worker); prometheus_client then keeps every
process's values in files there, and /metrics, in whichever process the scrape lands, reads them
all (prometheus_client's multiprocess mode). Without it (--workers 1) the series live in one
private registry, as they always did.

How each series adds up over processes:
- counters and histograms (requests, retries, latencies): summed, dead processes included, so a
  restarted worker never makes a total go down;
- pdserve_router_inflight_requests: 'livesum', the requests of the processes alive now;
- pdserve_router_worker_errors: 'sum', every process's failures, the dead ones' included;
- pdserve_router_worker_healthy: 'liveall', one series per live process (label `pid`): each
  process has its own health checks and circuit breakers (a circuit opened by one process's failed
  requests is that process's alone), so no single number is right; `min by (worker, role)` says
  whether every process routes to a server, `max` whether any does.
"""

from __future__ import annotations

import os
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from pdserve.router.http_protocol import REASONS as CONNECTION_GUARDS
from pdserve.router.loop_lag import GAUGE_WINDOW_S, LoopLag
from pdserve.router.metrics_env import MULTIPROC_DIR_ENV
from pdserve.router.workers import WorkerRegistry


class RouterMetrics:
    """The router's Prometheus series (served on /metrics)."""

    def __init__(self, registry: WorkerRegistry, loop_lag: LoopLag):
        self.registry = CollectorRegistry()
        r, self.workers, self.loop_lag = self.registry, registry, loop_lag
        self.requests = Counter("pdserve_router_requests", "HTTP API requests by status code.", ["status"], registry=r)
        buckets = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
        self.ttft = Histogram(
            "pdserve_router_time_to_first_token_seconds", "Time to first token.", registry=r, buckets=buckets
        )
        self.itl = Histogram(
            "pdserve_router_inter_token_latency_seconds", "Time between tokens.", registry=r, buckets=buckets
        )
        self.e2e = Histogram(
            "pdserve_router_e2e_latency_seconds", "Request (choice) latency, end to end.", registry=r, buckets=buckets
        )
        # TPOT (vLLM's, and the goodput SLOs'): a choice's time after its first token over its other tokens.
        self.tpot = Histogram(
            "pdserve_router_time_per_output_token_seconds",
            "Time per output token after the first, per choice of 2 or more tokens.",
            registry=r,
            buckets=(0.001, 0.002, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.25, 0.5, 1),
        )
        self.inflight = Gauge(
            "pdserve_router_inflight_requests", "Requests in flight.", registry=r, multiprocess_mode="livesum"
        )
        self.retries = Counter(
            "pdserve_router_prefill_retries", "Prefill attempts retried on another server.", registry=r
        )
        self.migrations = Counter(
            "pdserve_router_migrations",
            "Choices moved to another decode server after theirs failed (router/migration.py), by why it "
            "failed: hung (it stopped answering), unavailable (its call broke: the process died), ...",
            ["reason"],
            registry=r,
        )
        self.prefill_decisions = Counter(
            "pdserve_router_prefill_decisions",
            "Where choices were prefilled (router/disagg.py): local (the decode "
            "server) or remote (a prefill server), and why.",
            ["where", "reason"],
            registry=r,
        )
        self.worker_errors = Gauge(
            "pdserve_router_worker_errors",
            "Failed requests and health checks per worker.",
            ["worker", "role"],
            registry=r,
            multiprocess_mode="sum",
        )
        self.worker_healthy = Gauge(
            "pdserve_router_worker_healthy",
            "1 when the worker is routable.",
            ["worker", "role"],
            registry=r,
            multiprocess_mode="liveall",
        )
        self.event_loop_lag = Gauge(
            "pdserve_router_event_loop_lag_seconds",
            f"How late the router process's event loop ran at worst in the last {GAUGE_WINDOW_S:g} s "
            "(router/loop_lag.py): every request, stream and health check of the process waits on it.",
            registry=r,
            multiprocess_mode="liveall",
        )
        self.connections_closed = Counter(
            "pdserve_router_connections_closed",
            "Connections the router answered and closed itself (router/http_protocol.py): header_timeout "
            "(408: no whole request head within --header-timeout), body_timeout (408: no whole body within "
            "--body-timeout of its head), over_cap (503: past --max-connections-per-worker).",
            ["reason"],
            registry=r,
        )
        for reason in CONNECTION_GUARDS:
            self.connections_closed.labels(reason=reason)  # shown from the start, at 0
        self.exposition = self.registry
        path = os.environ.get(MULTIPROC_DIR_ENV)
        if path:
            self.exposition = CollectorRegistry()
            MultiProcessCollector(self.exposition, path)

    def update(self, inflight: int) -> None:
        """Write this process's gauges: its requests in flight, each server's errors and health.

        NOTE: with several processes a scrape is answered by one of them, from the values the
        others wrote last: each worker calls this about once a second (router/serve.py)."""
        self.inflight.set(inflight)
        now = time.monotonic()
        self.event_loop_lag.set(self.loop_lag.worst_since(now - GAUGE_WINDOW_S, now))
        for w in self.workers.workers.values():
            self.worker_errors.labels(worker=w.url, role=w.role).set(w.errors)
            self.worker_healthy.labels(worker=w.url, role=w.role).set(1 if w.routable(now) else 0)

    def render(self) -> bytes:
        """The exposition: this process's series, or with several processes, all of theirs."""
        return generate_latest(self.exposition)
