"""`pdserve up`: a local deployment in one command — decode and prefill servers and the router.

Starts every process, waits until the router's /readiness says both roles are healthy, prints the
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

from pdserve.common.config import DEFAULT_MEM_FRACTION_STATIC
from pdserve.common.ports import free_port
from pdserve.router.policies import POLICY_NAMES

READY_TIMEOUT_S = 300


def gpu_shares(num_servers: int, fraction: float = DEFAULT_MEM_FRACTION_STATIC) -> list[float]:
    """--mem-fraction-static for each of `num_servers` servers started one after another on one GPU.

    NOTE: the fraction is measured device-wide (whatever is in use counts), so server i of n asks
    for fraction × (i + 1) / n: the earlier servers' share is already in use when it measures.
    """
    return [round(fraction * (i + 1) / num_servers, 4) for i in range(num_servers)]


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


def _wait_serving(addr: str, procs: list[subprocess.Popen]) -> None:
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


def _on_one_gpu(device: str) -> bool:
    if device.startswith("cuda"):
        return True
    if device != "auto":
        return False
    import torch

    return torch.cuda.is_available()


def up(model_path: str | None, num_prefill: int, num_decode: int, device: str, port: int, host: str,
       prefill_policy: str = "round_robin", decode_policy: str = "round_robin", router_workers: int = 0) -> int:
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
    procs, prefill, decode = [], [], []
    try:
        # Servers sharing one GPU each size their KV cache from the memory they measure free, so
        # they start one at a time (gpu_shares).
        gpu = _on_one_gpu(device)
        shares = gpu_shares(num_decode + num_prefill)
        for role, count, urls in (("decode", num_decode, decode), ("prefill", num_prefill, prefill)):
            for _ in range(count):
                p = free_port()
                share = ["--mem-fraction-static", str(shares[len(procs)])] if gpu else []
                procs.append(subprocess.Popen([py, "-m", f"pdserve.{role}.cli", *common, *share, "--port", str(p),
                                               "--metrics-port", str(free_port())]))
                urls.append(f"127.0.0.1:{p}")
                if gpu:
                    _wait_serving(urls[-1], procs)
        procs.append(subprocess.Popen([py, "-m", "pdserve.router.cli", "--model-path", model_path, "--prefill", *prefill,
                                       "--decode", *decode, "--prefill-policy", prefill_policy, "--decode-policy",
                                       decode_policy, "--host", host, "--port", str(port), "--workers", str(router_workers),
                                       "--log-level", "warning", *secret]))
        base = f"http://{host}:{port}"
        _wait_ready(base + "/readiness", procs)
        print(f"pdserve is up: {base}  (model {model_path}; prefill {' '.join(prefill)}; decode {' '.join(decode)})")
        print(f"""try:
  curl {base}/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{{"model": "{model_path}", "messages": [{{"role": "user", "content": "Hello!"}}], "max_tokens": 16}}'
Ctrl-C stops everything.""", flush=True)
        stop = []
        signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
        while not stop and all(p.poll() is None for p in procs):
            time.sleep(0.5)
        return 0
    except KeyboardInterrupt:
        return 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(secret_dir, ignore_errors=True)


def add_parser(sub) -> None:
    """`pdserve up` on the `pdserve` command's sub-parsers (entry point group pdserve.commands)."""
    local = sub.add_parser("up", help="Start a local router + prefill + decode deployment (Ctrl-C stops it).")
    local.add_argument("--model-path", default=None, help="Checkpoint directory; default: a tiny llama made on the fly.")
    local.add_argument("--num-prefill", type=int, default=1, help="Prefill servers to start.")
    local.add_argument("--num-decode", type=int, default=1, help="Decode servers to start.")
    local.add_argument("--device", default="auto", help="cpu, cuda or auto.")
    local.add_argument("--host", default="127.0.0.1", help="Router HTTP address.")
    local.add_argument("--port", type=int, default=8000, help="Router HTTP port.")
    local.add_argument("--prefill-policy", default="round_robin", choices=POLICY_NAMES,
                       help="How the router picks a prefill server (cache_aware, prefix_hash: by prompt prefix).")
    local.add_argument("--decode-policy", default="round_robin", choices=("round_robin", "least_load"),
                       help="How the router picks a decode server.")
    local.add_argument("--router-workers", type=int, default=0,
                       help="The router's --workers: its processes; 0: from the CPU cores (see pdserve-router --help).")
    local.set_defaults(func=_up)


def _up(args) -> int:
    return up(args.model_path, args.num_prefill, args.num_decode, args.device, args.port, args.host,
              args.prefill_policy, args.decode_policy, args.router_workers)
