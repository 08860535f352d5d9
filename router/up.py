"""`pdserve up`: a local deployment in one command — decode and prefill servers and the router.

Picks the layout (router/layout.py: on one GPU the one measured to serve the most), places the
servers on the GPUs (router/placement.py: disjoint sets while they last), runs servers that share a
GPU under a private MPS daemon (router/gpu_sharing.py), prints all of it, starts every process
(printing where each server's start-up went), waits until the router's /readiness says both roles
are healthy, prints the URL and a curl example, and on Ctrl-C (or SIGTERM, or a server that exits)
stops everything: the servers first (SIGTERM: they drain), then the MPS daemon.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from typing import Callable

from pdserve.common.config import short_model_name
from pdserve.common.gpus import driver_device_memory
from pdserve.common.lifetime import parent_death_signal_setter
from pdserve.common.ports import free_port
from pdserve.common.startup import uncached_bytecode_hint
from pdserve.common.trust import RECONNECT_OPTIONS
from pdserve.router.config import default_workers
from pdserve.router.gpu_sharing import (
    DEFAULT_SM_SHARES,
    GpuSharing,
    parse_sm_shares,
    shared_gpus,
)
from pdserve.router.layout import checkpoint_bytes, choose_layout, without_mps
from pdserve.router.placement import (
    ROLES_IN_START_ORDER,
    ServerPlacement,
    describe,
    describe_kv_paths,
    kv_transfer_path,
    plan_placement,
    rank_threads,
    resolve_gpus,
    usable_cores,
    visible_gpu_names,
)

READY_TIMEOUT_S = 300
LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass(frozen=True)
class Passthrough:
    """What `pdserve up` hands its processes as given: `router` and `servers` are flags of
    pdserve-router and of prefill-server/decode-server; `served_model_name` and `api_key` (also in
    `router`) go into the example it prints."""

    log_level: str = "info"
    router: tuple[str, ...] = ()
    servers: tuple[str, ...] = ()
    served_model_name: str = ""
    api_key: str = ""


# After the servers serve, before asking the router's /readiness: each router process checks a starting
# server every 0.1 s (router/workers.py STARTING_CHECK_S), and /readiness is the view of whichever
# process answers it, so the others get two such checks and slack for a loaded host.
READY_MARGIN_S = 0.5
POLL_S = 0.1  # how often this process asks a server or the router whether it is ready


class ProcessExited(RuntimeError):
    """A process `pdserve up` started exited before it was ready (its own error is in the output above)."""

    def __init__(self, p: subprocess.Popen):
        super().__init__(f"{' '.join(p.args[:4])} exited with code {p.returncode} before it was ready")


def _wait_ready(url: str, procs: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        for p in procs:
            if p.poll() is not None:
                raise ProcessExited(p)
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(POLL_S)
    raise TimeoutError(f"not ready after {READY_TIMEOUT_S}s: {url}")


def wait_serving(addr: str, procs: list[subprocess.Popen]) -> None:
    """Until the server at addr reports SERVING on gRPC health (its model is loaded)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + READY_TIMEOUT_S
    with grpc.insecure_channel(addr, RECONNECT_OPTIONS) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            for p in procs:
                if p.poll() is not None:
                    raise ProcessExited(p)
            try:
                if (
                    stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status
                    == health_pb2.HealthCheckResponse.SERVING
                ):
                    return
            except grpc.RpcError:
                pass
            time.sleep(POLL_S)
    raise TimeoutError(f"not serving after {READY_TIMEOUT_S}s: {addr}")


def start_servers(
    plan: list[ServerPlacement],
    command: Callable[[ServerPlacement, int], list[str]],
    env_of: Callable[[ServerPlacement], dict[str, str]],
    procs: list[subprocess.Popen],
    run_dir: str,
    ports: list[int] | None = None,
) -> dict[str, list[str]]:
    """Start the planned servers together, each in its environment `env_of(server)` on its port
    (`ports`, one per server; default: free ones), and wait until every one serves; print how long
    each took. {role: [HOST:PORT, ...]}. `command(server, port)` is its command line; each also gets
    a --startup-report file in `run_dir`.

    Each server gets SIGTERM (and drains) if the thread that started it dies: a `pdserve up` that is
    killed leaves no server running.

    NOTE: servers on a shared GPU each size their KV cache from the memory they measure in use
    (plan_placement's cumulative fractions count on it), so they take the GPU one after another:
    each waits (--gpu-after) until the one before it in plan order has allocated its KV pool, and
    does everything before that (its interpreter, imports, tokenizer: most of a start) at once.
    """
    addresses: dict[str, list[str]] = {role: [] for role in ROLES_IN_START_ORDER}
    ports = ports or [free_port() for _ in plan]
    shared = shared_gpus(plan)
    previous_sharer = ""  # the report of the last server started on a shared GPU
    started: list[tuple[ServerPlacement, str, float]] = []  # (server, address, launched at)
    for server, port in zip(plan, ports):
        report = os.path.join(run_dir, f"{server.role}-{server.index}.startup.jsonl")
        flags = ["--startup-report", report]
        if shared & set(server.gpus):
            flags += ["--gpu-after", previous_sharer] if previous_sharer else []
            previous_sharer = report
        procs.append(
            subprocess.Popen(
                [*command(server, port), *flags],
                env=env_of(server),
                preexec_fn=parent_death_signal_setter(signal.SIGTERM),
            )
        )
        addresses[server.role].append(f"127.0.0.1:{port}")
        started.append((server, addresses[server.role][-1], time.monotonic()))
    for server, address, at in started:
        wait_serving(address, procs)
        print(f"  {server.role} {server.index} serving {time.monotonic() - at:.1f} s after its launch", flush=True)
    return addresses


def weights_share(model_path: str, placed_on: list[int]) -> float | None:
    """The checkpoint's bytes over the smallest placed GPU's memory (None: the driver cannot say)."""
    memory = driver_device_memory()
    if not memory or max(placed_on) >= len(memory):
        return None
    return checkpoint_bytes(model_path) / min(memory[g] for g in placed_on)


def up(
    model_path: str | None,
    num_prefill: int | None,
    num_decode: int | None,
    device: str,
    port: int,
    host: str,
    prefill_policy: str = "round_robin",
    decode_policy: str = "round_robin",
    router_workers: int = 0,
    gpus: str | None = None,
    prefill_tp: int = 1,
    decode_tp: int = 1,
    disagg_policy: str | None = None,
    mps: str = "auto",
    sm_shares: str = "auto",
    passthrough: Passthrough = Passthrough(),
) -> int:
    """`gpus`: --gpus as given (None: every visible GPU); `num_prefill`, `num_decode`, `disagg_policy`:
    None when not given (router/layout.py picks them); `mps`, `sm_shares`: router/gpu_sharing.py; `model_path`
    None: a tiny random llama made on the fly."""
    started_at = time.monotonic()
    shares = DEFAULT_SM_SHARES if sm_shares == "auto" else parse_sm_shares(sm_shares)
    visible = visible_gpu_names() if device != "cpu" else []
    device, placed_on = resolve_gpus(device, gpus, visible)
    if model_path is None:
        from pdserve.common.tiny_model import make_tiny_model

        model_path = str(make_tiny_model(os.path.join(tempfile.gettempdir(), "pdserve-tiny-llama"), "llama"))
    share = weights_share(model_path, placed_on) if len(placed_on) > 1 else None
    layout = choose_layout(len(placed_on), num_prefill, disagg_policy, num_decode, max(prefill_tp, decode_tp), share)
    plan = plan_placement(placed_on, layout.num_prefill, prefill_tp, layout.num_decode, decode_tp)
    from pdserve.common.trust import write_secret_file

    py = sys.executable
    # The run's directory, only this user's: a fresh cluster secret (every server requires it, the
    # router sends it: docs/deploy/security.md, "Trust"), the MPS daemon's pipes, the start-up reports.
    run_dir = tempfile.mkdtemp(prefix="pdserve-up-")
    secret = ["--cluster-secret-file", write_secret_file(run_dir)]
    procs: list[subprocess.Popen] = []
    sharing = None
    # From here on SIGTERM and SIGINT stop everything, even mid-start, whatever was inherited: a shell
    # starts a background job (`pdserve up &` in a script) with SIGINT ignored, and Python then leaves it so.
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    try:
        sharing = GpuSharing.start(plan, run_dir, mps, shares)
        if sharing.unavailable and without_mps(layout, sharing.unavailable, len(placed_on)) != layout:
            layout = without_mps(layout, sharing.unavailable, len(placed_on))
            plan = plan_placement(placed_on, layout.num_prefill, prefill_tp, layout.num_decode, decode_tp)
            sharing = GpuSharing.start(plan, run_dir, mps, shares)
        tp_of = {"prefill": prefill_tp, "decode": decode_tp}
        threads = rank_threads(layout.num_prefill * prefill_tp + layout.num_decode * decode_tp, usable_cores())
        common = ["--model-path", model_path, "--device", device, "--log-level", passthrough.log_level, *secret]
        common += passthrough.servers
        metrics: dict[str, str] = {}  # "prefill 0" -> its /metrics URL

        def command(server: ServerPlacement, port: int) -> list[str]:
            tp = tp_of[server.role]
            flags = ["--tp-size", str(tp)]
            if server.gpus:
                flags += ["--mem-fraction-static", str(server.mem_fraction)]
            elif tp > 1:
                flags += ["--torch-threads", str(threads)]  # the ranks must not fight over the cores
            metrics_port = free_port()
            metrics[f"{server.role} {server.index}"] = f"http://127.0.0.1:{metrics_port}/metrics"
            return [
                py,
                "-m",
                f"pdserve.{server.role}.cli",
                *common,
                *flags,
                "--port",
                str(port),
                "--metrics-port",
                str(metrics_port),
            ]

        print(
            f"placement ({len(placed_on)} GPUs: {','.join(map(str, placed_on))}):" if placed_on else "placement (CPU):"
        )
        print("\n".join(describe(plan, tp_of, visible)))
        print("\n".join(describe_kv_paths(plan, kv_transfer_path(passthrough.servers))))
        print(
            f"layout: {layout.num_prefill} prefill, {layout.num_decode} decode, --disagg-policy {layout.disagg_policy} "
            f"({layout.why})"
        )
        print(sharing.describe(), flush=True)
        # The router starts first, beside the servers: it needs as long as a small model's server to
        # start (its imports and tokenizer), and counts no failure against a server still starting.
        ports = [free_port() for _ in plan]
        prefill = [f"127.0.0.1:{p}" for server, p in zip(plan, ports) if server.role == "prefill"]
        decode = [f"127.0.0.1:{p}" for server, p in zip(plan, ports) if server.role == "decode"]
        prefill_flags = ["--prefill", *prefill] if prefill else []
        procs.append(
            subprocess.Popen(
                [
                    py,
                    "-m",
                    "pdserve.router.cli",
                    "--model-path",
                    model_path,
                    *prefill_flags,
                    "--decode",
                    *decode,
                    "--prefill-policy",
                    prefill_policy,
                    "--decode-policy",
                    decode_policy,
                    "--disagg-policy",
                    layout.disagg_policy,
                    "--host",
                    host,
                    "--port",
                    str(port),
                    "--workers",
                    str(router_workers),
                    "--log-level",
                    passthrough.log_level,
                    *secret,
                    *passthrough.router,
                ],
                preexec_fn=parent_death_signal_setter(signal.SIGTERM),
            )
        )
        start_servers(plan, command, lambda server: sharing.server_env(server, visible), procs, run_dir, ports)
        # NOTE: /readiness is answered by one router worker (READY_MARGIN_S: the others' checks); a
        # router of one process answers from the only view there is.
        if (router_workers or default_workers()) > 1:
            time.sleep(READY_MARGIN_S)
        base = f"http://{host}:{port}"
        _wait_ready(base + "/readiness", procs)
        name = passthrough.served_model_name or short_model_name(model_path)
        print(
            f"pdserve is up after {time.monotonic() - started_at:.1f} s: {base}  (model {name}: {model_path}; "
            f"prefill {' '.join(prefill) or 'none'}; decode {' '.join(decode)})"
        )
        hint = uncached_bytecode_hint()
        if hint:
            print(hint)
        print("metrics: " + ", ".join(f"{who} {url}" for who, url in [("router", base + "/metrics"), *metrics.items()]))
        key = f" -H 'Authorization: Bearer {passthrough.api_key}'" if passthrough.api_key else ""
        body = {"model": name, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 32}
        print(
            f"""try:
  curl {base}/v1/chat/completions -H 'Content-Type: application/json'{key} \\
    -d '{json.dumps(body)}'
Ctrl-C stops everything.""",
            flush=True,
        )
        while all(p.poll() is None for p in procs):
            time.sleep(0.5)
        return 0
    except KeyboardInterrupt:
        return 0
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):  # already stopping: a second one must not cut it short
            signal.signal(sig, signal.SIG_IGN)
        stop_processes(procs)
        if sharing is not None:
            sharing.stop()  # after the servers: an MPS client loses its GPU when the daemon goes
        shutil.rmtree(run_dir, ignore_errors=True)


def stop_processes(procs: list[subprocess.Popen], grace_s: float = 60) -> None:
    """SIGTERM every process still running (the servers drain), then wait; kill any that outlasts `grace_s`."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(grace_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _interrupt(*_) -> None:
    raise KeyboardInterrupt
