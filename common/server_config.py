"""What a prefill or decode server adds to the engine's flags (ServerConfig), and the flags the router
and both servers share to trust each other (TrustConfig); their CLI flags are generated from the
fields as the engine's are (common/config.py add_cli_args)."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.common.config import option


@dataclass(frozen=True, kw_only=True)
class TrustConfig:
    """Who may call a server: the flags the router and both servers share (common/trust.py reads
    them; docs/deploy/security.md, "Trust"). Keyword-only, so a config inheriting them keeps its own
    fields' positions and lists these flags last."""

    cluster_secret_file: str = option(
        "",
        "File holding the cluster secret that the router sends and the servers require on every RPC but "
        "grpc.health.v1 (at least 16 printable characters; several lines: the first is sent, any is accepted, "
        "for rotation). Default: $PDSERVE_CLUSTER_SECRET_FILE, else the secret itself in $PDSERVE_CLUSTER_SECRET.",
        metavar="PATH",
    )
    tls_cert: str = option(
        "",
        "PEM certificate chain: a server's own; the router's client certificate. With --tls-key and --tls-ca: "
        "mutual TLS on every server RPC.",
        metavar="PATH",
    )
    tls_key: str = option("", "PEM private key of --tls-cert.", metavar="PATH")
    tls_ca: str = option(
        "",
        "PEM CA bundle: servers require client certificates it signed; the router checks the servers' against "
        "it (the name checked is the one given in --prefill/--decode or --prefill-dns/--decode-dns).",
        metavar="PATH",
    )
    allow_unauthenticated: bool = option(
        False,
        "Start on (servers) or reach servers at (router) a non-loopback address without a cluster secret or "
        "TLS: anyone who reaches a server's port may then call every RPC.",
    )


@dataclass(frozen=True)
class ServerConfig(TrustConfig):
    """What a prefill or decode server adds to the engine's flags."""

    host: str = option("127.0.0.1", "Address the gRPC service (and the metrics port) listen on.")
    port: int = option(0, "gRPC port (required).")
    metrics_port: int = option(0, "Prometheus /metrics port; 0: no metrics endpoint.")
    otlp_traces_endpoint: str = option(
        "",
        "Send OpenTelemetry spans of each request's stages here (OTLP/gRPC, e.g. http://collector:4317); needs "
        "pip install 'pdserve[tracing]'. Default: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else no tracing.",
    )
    transfer_backend: str = option("nixl", "KV transfer backend: nixl (UCX; DRAM on CPU, VRAM on CUDA).")
    kv_transfer_path: str = option(
        "auto",
        "Prefill -> decode KV: auto: a device copy (CUDA IPC, one kernel a request) into decode pools this host's "
        "GPUs can map, else NIXL; direct: the copy or refuse the decode server; nixl: NIXL always (as between hosts).",
        choices=("auto", "direct", "nixl"),
    )
    kv_transfer_timeout: float = option(
        30.0, "Seconds a KV transfer may take: decode aborts a request whose KV has not arrived, prefill fails it."
    )
    kv_integrity_check: bool = option(
        False,
        "Decode servers: check each KV WRITE's checksum (the prefill server computes it over the pages it sends) "
        "before decoding the pages; a mismatch fails the request with KV_TRANSFER_FAILED and the router moves it "
        "to another decode server. Off by default: on a GPU each sum waits for the device (the GPT-2 burst served "
        "0.40x on an H200: docs/benchmarks/transfers.md). Prefill servers add the checksum wherever a decode "
        "server asks for it. With --tp-size > 1 each rank sums the pages that landed in its own KV heads.",
    )
    torch_threads: int = option(
        0,
        "CPU threads torch may use in the scheduler process; 0: torch's default, one per core. (Splitting a 2-core "
        "host between a prefill and a decode server cost a quarter of the throughput: docs/benchmarks/.)",
    )
    startup_timeout: float = option(
        300.0,
        "Seconds the scheduler process may take to start (load the model, size and allocate the KV cache, "
        "capture CUDA graphs) before the server gives up.",
    )
    drain_timeout: float = option(
        120.0, "Seconds a SIGTERM'd server waits for its requests in flight to finish before it exits anyway."
    )
    disable_grammar_warmup: bool = option(
        False,
        "Make structured output's machinery (xgrammar, the tokenizer's description, the grammar worker process, "
        "a first compile) on the first grammar request instead of during start-up: for a server that never "
        "serves one (it then starts no grammar worker).",
    )
    startup_report: str = option(
        "",
        "A file the scheduler appends its start-up phases to as they end, one JSON line each (pdserve up "
        "reads it: a server sharing a GPU starts once the one before has allocated its KV pool); default: none. "
        "The phases are printed once the server is up either way.",
    )
    gpu_after: str = option(
        "",
        "Another server's --startup-report file: this server touches the GPU only once that one has "
        "allocated its KV pool (pdserve up starts servers sharing a GPU together: each sizes its KV cache from "
        "the memory it measures in use); default: at once.",
    )
    agent_name: str = option("", "Unique name of this server's transfer agent; default: role-host-port-random.")
    log_level: str = option("info", "Logging level (debug, info, warning, error).")

    def check(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError("--port is required (1-65535)")
        if self.transfer_backend != "nixl":
            raise ValueError(f"--transfer-backend must be nixl, got {self.transfer_backend!r}")
        if self.torch_threads < 0:
            raise ValueError(f"--torch-threads must be >= 0, got {self.torch_threads}")
        for name in ("kv_transfer_timeout", "startup_timeout", "drain_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)}")
