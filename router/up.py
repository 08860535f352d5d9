"""`pdserve up`: a local deployment in one command — decode and prefill servers and the router.

Places the servers on the GPUs (router/placement.py: disjoint sets while they last), prints where,
starts every process, waits until the router's /readiness says both roles are healthy, prints the
URL and a curl example, and on Ctrl-C (or SIGTERM) stops everything (SIGTERM: the servers drain).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Callable

from pdserve.common.ports import free_port
from pdserve.router.placement import (
    ROLES_IN_START_ORDER, ServerPlacement, describe, plan_placement, rank_threads, resolve_gpus, server_env,
    usable_cores, visible_gpu_names,
)
from pdserve.router.disagg import POLICIES
from pdserve.router.policies import POLICY_NAMES

READY_TIMEOUT_S = 300


def _wait_ready(url: str, procs: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"{' '.join(p.args[:4])} exited with code {p.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"not ready after {READY_TIMEOUT_S}s: {url}")


def wait_serving(addr: str, procs: list[subprocess.Popen]) -> None:
    """Until the server at addr reports SERVING on gRPC health (its model is loaded)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + READY_TIMEOUT_S
    with grpc.insecure_channel(addr) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            for p in procs:
                if p.poll() is not None:
                    raise RuntimeError(f"{' '.join(p.args[:4])} exited with code {p.returncode}")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.3)
    raise TimeoutError(f"not serving after {READY_TIMEOUT_S}s: {addr}")


def start_servers(plan: list[ServerPlacement], command: Callable[[ServerPlacement, int], list[str]],
                  visible: list[str], procs: list[subprocess.Popen]) -> dict[str, list[str]]:
    """Start the planned servers in plan order, each seeing only its GPUs, and wait until every one
    serves (the router, started next, would otherwise open circuits on the ones still loading);
    {role: [HOST:PORT, ...]}. `command(server, port)` is its command line.

    NOTE: a server that shares a GPU with an earlier one starts only once that one serves: each
    sizes its KV cache from the memory it measures in use (plan_placement's fractions count on it).
    """
    addresses: dict[str, list[str]] = {role: [] for role in ROLES_IN_START_ORDER}
    started: list[tuple[ServerPlacement, str]] = []
    for server in plan:
        for earlier, address in started:
            if set(earlier.gpus) & set(server.gpus):
                wait_serving(address, procs)
        port = free_port()
        procs.append(subprocess.Popen(command(server, port), env=server_env(server, visible)))
        addresses[server.role].append(f"127.0.0.1:{port}")
        started.append((server, addresses[server.role][-1]))
    for _server, address in started:
        wait_serving(address, procs)
    return addresses


def up(model_path: str | None, num_prefill: int, num_decode: int, device: str, port: int, host: str,
       prefill_policy: str = "round_robin", decode_policy: str = "round_robin", router_workers: int = 0,
       gpus: str | None = None, prefill_tp: int = 1, decode_tp: int = 1, disagg_policy: str = "always") -> int:
    """`gpus`: --gpus as given (None: every visible GPU)."""
    if num_prefill == 0 and disagg_policy != "never":
        raise ValueError("--num-prefill 0 needs --disagg-policy never (decode servers then prefill every request)")
    visible = visible_gpu_names() if device != "cpu" else []
    device, placed_on = resolve_gpus(device, gpus, visible)
    plan = plan_placement(placed_on, num_prefill, prefill_tp, num_decode, decode_tp)
    tp_of = {"prefill": prefill_tp, "decode": decode_tp}
    threads = rank_threads(num_prefill * prefill_tp + num_decode * decode_tp, usable_cores())
    if model_path is None:
        from pdserve.common.tiny_model import make_tiny_model

        model_path = str(make_tiny_model(os.path.join(tempfile.gettempdir(), "pdserve-tiny-llama"), "llama"))
    from pdserve.common.trust import write_secret_file

    py = sys.executable
    # A fresh cluster secret for this run, in a directory only this user can read: every server
    # requires it, the router sends it (docs/operations.md, "Trust").
    secret_dir = tempfile.mkdtemp(prefix="pdserve-up-")
    secret = ["--cluster-secret-file", write_secret_file(secret_dir)]
    common = ["--model-path", model_path, "--device", device, "--log-level", "warning", *secret]

    def command(server: ServerPlacement, port: int) -> list[str]:
        tp = tp_of[server.role]
        flags = ["--tp-size", str(tp)]
        if server.gpus:
            flags += ["--mem-fraction-static", str(server.mem_fraction)]
        elif tp > 1:
            flags += ["--torch-threads", str(threads)]  # the ranks must not fight over the cores
        return [py, "-m", f"pdserve.{server.role}.cli", *common, *flags, "--port", str(port),
                "--metrics-port", str(free_port())]

    print(f"placement ({len(placed_on)} GPUs: {','.join(map(str, placed_on))}):" if placed_on else "placement (CPU):")
    print("\n".join(describe(plan, tp_of, visible)), flush=True)
    procs: list[subprocess.Popen] = []
    signal.signal(signal.SIGTERM, _interrupt)  # from here on SIGTERM stops everything, even mid-start
    try:
        servers = start_servers(plan, command, visible, procs)
        prefill, decode = servers["prefill"], servers["decode"]
        prefill_flags = ["--prefill", *prefill] if prefill else []
        procs.append(subprocess.Popen([py, "-m", "pdserve.router.cli", "--model-path", model_path, *prefill_flags,
                                       "--decode", *decode, "--prefill-policy", prefill_policy, "--decode-policy",
                                       decode_policy, "--disagg-policy", disagg_policy, "--host", host, "--port", str(port),
                                       "--workers", str(router_workers), "--log-level", "warning", *secret]))
        base = f"http://{host}:{port}"
        _wait_ready(base + "/readiness", procs)
        print(f"pdserve is up: {base}  (model {model_path}; prefill {' '.join(prefill)}; decode {' '.join(decode)})")
        print(f"""try:
  curl {base}/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{{"model": "{model_path}", "messages": [{{"role": "user", "content": "Hello!"}}], "max_tokens": 16}}'
Ctrl-C stops everything.""", flush=True)
        while all(p.poll() is None for p in procs):
            time.sleep(0.5)
        return 0
    except KeyboardInterrupt:
        return 0
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # already stopping: a second one must not cut it short
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(secret_dir, ignore_errors=True)


def _interrupt(*_) -> None:
    raise KeyboardInterrupt


def add_parser(sub) -> None:
    """`pdserve up` on the `pdserve` command's sub-parsers (entry point group pdserve.commands)."""
    local = sub.add_parser("up", help="Start a local router + prefill + decode deployment (Ctrl-C stops it).")
    local.add_argument("--model-path", default=None, help="Checkpoint directory or GGUF file; default: a tiny llama made on the fly.")
    local.add_argument("--num-prefill", type=int, default=1, help="Prefill servers to start.")
    local.add_argument("--num-decode", type=int, default=1, help="Decode servers to start.")
    local.add_argument("--device", default="auto", help="cpu, cuda or auto (cuda when a GPU is visible).")
    local.add_argument("--gpus", default=None, metavar="0,1,...",
                       help="GPUs to place the servers on, numbered as this process sees them; default: every visible "
                            "one. Each server gets as many as its TP size, its own while they last, then shared.")
    local.add_argument("--prefill-tp", type=int, default=1, help="--tp-size of each prefill server (a GPU per rank).")
    local.add_argument("--decode-tp", type=int, default=1, help="--tp-size of each decode server (a GPU per rank).")
    local.add_argument("--host", default="127.0.0.1", help="Router HTTP address.")
    local.add_argument("--port", type=int, default=8000, help="Router HTTP port.")
    local.add_argument("--prefill-policy", default="round_robin", choices=POLICY_NAMES,
                       help="How the router picks a prefill server (cache_aware, prefix_hash: by prompt prefix).")
    local.add_argument("--decode-policy", default="round_robin", choices=POLICY_NAMES,
                       help="How the router picks a decode server.")
    local.add_argument("--disagg-policy", default="always", choices=POLICIES,
                       help="always: prefill servers prefill every request; never: decode servers do (colocated "
                            "replicas; with --num-prefill 0); auto: decode servers take short prompts (pdserve-router "
                            "--help).")
    local.add_argument("--router-workers", type=int, default=0,
                       help="The router's --workers: its processes; 0: from the CPU cores (see pdserve-router --help).")
    local.set_defaults(func=_up)


def _up(args) -> int:
    try:
        return up(args.model_path, args.num_prefill, args.num_decode, args.device, args.port, args.host,
                  args.prefill_policy, args.decode_policy, args.router_workers, args.gpus, args.prefill_tp,
                  args.decode_tp, args.disagg_policy)
    except ValueError as e:  # bad flags (placement, device): up() checks them before it starts anything
        print(f"error: {e}", file=sys.stderr)
        return 2
