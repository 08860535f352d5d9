"""The router's configuration: one frozen dataclass, its `pdserve-router` flags generated from the
fields (common/config.py's `add_cli_args`). Every timeout and interval the router uses is here.

Importing this module must not import torch, grpc or the HTTP stack (the CLI parses flags first).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from pdserve.common.config import option
from pdserve.common.openai.defaults import FLAG_HELP
from pdserve.common.server_config import TrustConfig
from pdserve.router.disagg import FALLBACKS, POLICIES
from pdserve.router.policies import make_policy

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")  # what both logging and uvicorn take


@dataclass(frozen=True)
class RouterConfig(TrustConfig):
    """Everything `pdserve-router` takes. Flags are `--field-name`; durations are in seconds. The
    cluster secret and TLS flags (TrustConfig) come last."""

    model_path: str = option(
        "", "Checkpoint directory, or GGUF file: the tokenizer, chat template and limits come from it.", required=True
    )
    prefill: tuple[str, ...] = option((), "Prefill servers (gRPC).", metavar="HOST:PORT")
    decode: tuple[str, ...] = option((), "Decode servers (gRPC).", metavar="HOST:PORT")
    prefill_dns: tuple[str, ...] = option(
        (),
        "Discover prefill servers: NAME (e.g. a headless Service) is resolved every --dns-interval seconds; "
        "addresses are added (once healthy) and removed as they come and go.",
        metavar="NAME:PORT",
    )
    decode_dns: tuple[str, ...] = option((), "Discover decode servers, likewise.", metavar="NAME:PORT")
    served_model_name: str = option(
        "",
        "Model name clients use; default: the checkpoint's short name (its directory's, or its file's without "
        ".gguf). --model-path as given is accepted too.",
    )
    context_length: int = option(
        0, "Longest sequence (prompt + output) a request may ask for; 0: the model's (give the servers' if smaller)."
    )
    generation_config: str = option("auto", FLAG_HELP["generation_config"])
    override_generation_config: str = option("", FLAG_HELP["override_generation_config"])
    default_max_tokens: int = option(0, FLAG_HELP["default_max_tokens"])
    api_key: str = option("", "Require 'Authorization: Bearer KEY' on the API.")
    prefill_policy: str = option(
        "round_robin",
        "round_robin, least_load, cache_aware (a radix tree of the prompts this process routed) or "
        "prefix_hash (rendezvous hashing of the prompt's first 64 tokens: every router process and "
        "replica decides alike). With --workers > 1, cache_aware runs as prefix_hash.",
    )
    decode_policy: str = option(
        "round_robin",
        "round_robin, least_load, cache_aware or prefix_hash (decode servers keep prompts in their prefix "
        "cache, and a transfer sends only the pages after the prefix a decode server holds).",
    )
    decode_stream: str = option(
        "shared",
        "How requests reach a decode server: 'shared' (one GenerateMany call per decode server carries "
        "every request, one message per step) or 'per-request' (a Generate call each; for servers "
        "older than GenerateMany this happens anyway).",
    )
    max_inflight: int = option(
        1024,
        "Choices (a prompt x n each: a request on a prefill and a decode server) this router process runs "
        "at once; requests beyond it wait in the queue (--max-queued, --queue-timeout).",
    )
    max_queued: int = option(
        1024,
        "Requests that may wait for a turn when --max-inflight choices run; beyond it a request gets 429 "
        "with Retry-After at once (0: no queue).",
    )
    queue_timeout: float = option(
        30.0, "Seconds a request may wait in the queue for its turn before it gets 429 with Retry-After."
    )
    max_choices: int = option(
        256,
        "Most choices (prompts x n) one request may ask for; beyond it the request gets 400 naming this "
        "limit (vLLM's default batch is 256 sequences).",
    )
    max_choices_at_once: int = option(
        16,
        "Choices of one request that run at once (each holds one of the --max-inflight slots); the rest "
        "follow as these finish, so one large request cannot fill the servers.",
    )
    max_body_bytes: int = option(
        0,
        "Largest request body read; a larger one gets 413 before it is parsed (0: from the model's context "
        "length, 64 bytes a token, at least 16 MiB).",
    )
    request_timeout: float = option(600.0, "Seconds a request may take (its deadline on both servers).")
    stream_send_timeout: float = option(
        30.0,
        "Seconds a streamed answer may wait for its client to take a chunk (the client stopped reading and "
        "the buffers are full); past it the client is dropped and its request aborted on the servers.",
    )
    header_timeout: float = option(
        20.0,
        "Seconds a connection may take to send a whole request head (from its accept, or from the first "
        "byte of a next request on a kept-alive connection); past it the answer is 408 and the connection "
        "is closed.",
    )
    body_timeout: float = option(
        60.0,
        "Seconds a request's body may take to come whole once its head has; past it the answer is 408 and the "
        "connection is closed (a 16 MiB body must come at 280 KB/s or faster at the default).",
    )
    max_connections_per_worker: int = option(
        0,
        "Connections each router process serves at once; one more is answered 503 with Retry-After and "
        "closed before it is read (0: 4096, or the open-file limit less 256 where that is lower; each process "
        "raises its soft open-file limit to the hard one at start).",
    )
    prefill_timeout: float = option(
        0.0,
        "Seconds one prefill attempt may take before it is retried elsewhere; 0: the request's deadline "
        "(never past it).",
    )
    decode_timeout: float = option(0.0, "Seconds the decode call may take; 0: the request's deadline (never past it).")
    max_prefill_attempts: int = option(3, "Prefill servers a request is tried on before it fails.")
    max_migrations: int = option(
        1,
        "Times a choice is moved to another decode server when its own dies or hangs: the prompt and the "
        "tokens already sent are prefilled again and the stream goes on as it would have "
        "(router/migration.py). 0: such a stream ends with an error.",
    )
    disagg_policy: str = option(
        "always",
        "always: every request is prefilled on a prefill server and its KV sent to the decode server; "
        "never: decode servers prefill every request themselves (colocated replicas; no prefill server "
        "needed); auto: locally when the prompt is at most --local-prefill-max-tokens or the prefill "
        "servers are all loaded past --prefill-queue-threshold, remotely otherwise (router/disagg.py).",
    )
    prefill_fallback: str = option(
        "fail",
        "With --disagg-policy always, when no prefill server is healthy: fail (requests get a 503 saying so) or "
        "local (decode servers prefill them, as replicas would). Either way it is counted "
        "(pdserve_router_prefill_decisions_total, reason no_prefill_server) and logged once per outage. "
        "(auto always falls back to local; never needs no prefill server.)",
    )
    local_prefill_max_tokens: int = option(
        256,
        "With --disagg-policy auto: prompts of at most this many uncached tokens are prefilled by the decode "
        "server (uncached: past the longest prefix of the prompts this router sent that server, which its prefix "
        "cache keeps).",
    )
    prefill_queue_threshold: int = option(
        64,
        "With --disagg-policy auto: when every healthy prefill server reports at least this many running + "
        "waiting requests (plus this router's in flight), requests are prefilled locally.",
    )
    health_check_interval: float = option(1.0, "Seconds between two health checks (gRPC health + GetLoad) of a worker.")
    health_check_timeout: float = option(2.0, "Seconds each health-check RPC may take.")
    dns_interval: float = option(2.0, "Seconds between two resolutions of the --prefill-dns / --decode-dns names.")
    circuit_failures: int = option(3, "Consecutive failed requests or health checks that open a worker's circuit.")
    circuit_open_time: float = option(5.0, "Seconds an open circuit keeps its worker out of routing (then half-open).")
    host: str = option("127.0.0.1", "HTTP listen address.")
    port: int = option(8000, "HTTP port.")
    workers: int = option(
        0,
        "Router processes serving --port (SO_REUSEPORT), each with its own gRPC channels and health checks, "
        "under a supervisor that restarts them; 1: one process, no supervisor. 0: half the usable CPU cores "
        "(the rest left to the servers and clients on the host), from 1 to 8 (every process health-checks "
        "every server and holds its own tokenizer).",
    )
    no_warm_spare: bool = option(
        False,
        "With --workers > 1, keep no warm spare: by default one more process, built but not listening, "
        "takes a dead worker's place at once (a worker started afresh takes seconds to listen).",
    )
    drain_timeout: float = option(
        120.0,
        "Seconds a stopping router process (SIGTERM) waits for its requests and streams in flight to finish; "
        "past it they are cut. Idle connections are closed at once; a slow head or body is bounded by "
        "--header-timeout and --body-timeout meanwhile.",
    )
    log_level: str = option("info", "Logging level (debug adds uvicorn's access log: a line per HTTP request).")
    otlp_traces_endpoint: str = option(
        "",
        "Send OpenTelemetry spans of each request (a trace across the router and both servers, continuing a "
        "client's W3C traceparent) here (OTLP/gRPC, e.g. http://collector:4317); needs pip install "
        "'pdserve[tracing]'. Default: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else no tracing.",
    )

    def check(self) -> None:
        """Raise ValueError, naming the flag, for the first value the router cannot run with."""
        if not self.model_path:
            raise ValueError("--model-path is required")
        if self.disagg_policy not in POLICIES:
            raise ValueError(f"--disagg-policy must be always, never or auto, got {self.disagg_policy!r}")
        if self.prefill_fallback not in FALLBACKS:
            raise ValueError(f"--prefill-fallback must be fail or local, got {self.prefill_fallback!r}")
        if not (self.decode or self.decode_dns):
            raise ValueError("give decode servers (--decode or --decode-dns)")
        if not (self.prefill or self.prefill_dns) and self.disagg_policy != "never":
            raise ValueError(
                "give prefill servers (--prefill or --prefill-dns), or --disagg-policy never "
                "(decode servers prefill every request themselves)"
            )
        if self.local_prefill_max_tokens < 0 or self.prefill_queue_threshold < 1:
            raise ValueError("--local-prefill-max-tokens must be >= 0 and --prefill-queue-threshold >= 1")
        for spec in self.prefill_dns + self.decode_dns:
            name_port(spec)
        for role, name in (("prefill", self.prefill_policy), ("decode", self.decode_policy)):
            try:
                make_policy(name, role)
            except ValueError as e:
                raise ValueError(f"--{role}-policy: {e}") from None
        if self.decode_stream not in ("shared", "per-request"):
            raise ValueError(f"--decode-stream must be shared or per-request, got {self.decode_stream!r}")
        if self.workers < 0:
            raise ValueError(f"--workers must be >= 0 (0: from the CPU cores), got {self.workers}")
        if self.port == 0 and self.workers != 1:
            raise ValueError("--port 0 (any free port) needs --workers 1: every worker must bind the same port")
        for name in ("max_inflight", "max_prefill_attempts", "circuit_failures", "max_choices", "max_choices_at_once"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.max_migrations < 0:
            raise ValueError(f"--max-migrations must be >= 0 (0: none), got {self.max_migrations}")
        if self.max_queued < 0:
            raise ValueError(f"--max-queued must be >= 0 (0: no queue), got {self.max_queued}")
        if self.context_length < 0 or self.default_max_tokens < 0:
            raise ValueError("--context-length and --default-max-tokens must be >= 0 (0: the model's / the context)")
        if self.max_body_bytes < 0:
            raise ValueError(f"--max-body-bytes must be >= 0 (0: from the context length), got {self.max_body_bytes}")
        if self.max_connections_per_worker < 0:
            raise ValueError(
                "--max-connections-per-worker must be >= 0 (0: from the open-file limit), "
                f"got {self.max_connections_per_worker}"
            )
        for name in (
            "request_timeout",
            "health_check_interval",
            "health_check_timeout",
            "dns_interval",
            "circuit_open_time",
            "queue_timeout",
            "stream_send_timeout",
            "header_timeout",
            "body_timeout",
            "drain_timeout",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)}")
        for name in ("prefill_timeout", "decode_timeout"):
            if not getattr(self, name) >= 0:
                raise ValueError(
                    f"--{name.replace('_', '-')} must be >= 0 (0: the request's deadline), got {getattr(self, name)}"
                )
        if self.log_level.lower() not in LOG_LEVELS:
            raise ValueError(f"--log-level must be debug, info, warning, error or critical, got {self.log_level!r}")

    def resolve(self) -> RouterConfig:
        """Fill the auto values: --workers 0 from the cores, and cache_aware's form for several
        processes (a per-process radix tree would send one prefix to as many servers as processes)."""
        workers = self.workers or default_workers()

        def across(policy: str) -> str:
            return "prefix_hash" if workers > 1 and policy == "cache_aware" else policy

        return replace(
            self, workers=workers, prefill_policy=across(self.prefill_policy), decode_policy=across(self.decode_policy)
        )


def default_workers() -> int:
    """Half the CPU cores this process may run on, at least 1 and at most 8 (see --workers).

    NOTE: the cores of the affinity mask, not the host's; a cgroup CPU quota (a Kubernetes limit) is
    not seen: give --workers there."""
    return max(1, min(8, len(os.sched_getaffinity(0)) // 2))


def name_port(spec: str) -> tuple[str, int]:
    """NAME:PORT -> (NAME, PORT); ValueError otherwise."""
    name, sep, port = spec.rpartition(":")
    if not sep or not name or not port.isdigit():
        raise ValueError(f"expected NAME:PORT, got {spec!r}")
    return name, int(port)
