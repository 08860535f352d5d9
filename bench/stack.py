"""`bench serve` without --base-url: a local router + 1 prefill + 1 decode server, as `pdserve up`
starts them, but with the benchmark's engine flags (so --disable-overlap-schedule and friends apply).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from typing import Callable, Iterator

from pdserve.common.config import DEFAULT_MEM_FRACTION_STATIC, EngineConfig
from pdserve.common.ports import free_port
from pdserve.common.trust import write_secret_file
from pdserve.router.up import READY_TIMEOUT_S, gpu_shares


def engine_flags(config: EngineConfig) -> list[str]:
    """The command-line flags of every field that differs from its default (and --model-path)."""
    flags = []
    for f in dataclasses.fields(EngineConfig):
        value = getattr(config, f.name)
        if value == f.default and f.name != "model_path":
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(f.default, bool):
            flags.append(flag)
        else:
            flags += [flag, str(value)]
    return flags


def memory_split(config: EngineConfig, device: str, num_prefill: int = 1) -> tuple[EngineConfig, list[EngineConfig]]:
    """(decode, [prefill, ...]) configs sharing one GPU: started one after another, the decode
    server first, each with its cumulative share of --mem-fraction-static (router/up.py's
    gpu_shares, as `pdserve up` does). Explicit sizes (--max-total-tokens, --kv-cache-memory-gb)
    apply to each as given.
    """
    if not device.startswith("cuda") or config.max_total_tokens or config.kv_cache_memory_gb:
        return config, [config] * num_prefill
    fraction = config.mem_fraction_static or DEFAULT_MEM_FRACTION_STATIC
    shares = [dataclasses.replace(config, mem_fraction_static=f) for f in gpu_shares(num_prefill + 1, fraction)]
    return shares[0], shares[1:]


@dataclasses.dataclass(frozen=True)
class LocalStack:
    base_url: str  # the router's
    prefill: str  # HOST:PORT of the prefill server's gRPC service
    decode: str  # HOST:PORT of the decode server's
    router_pid: int = 0  # the router's process, for its CPU time (with router_workers > 1: the supervisor's only)
    cluster_secret_file: str = ""  # the run's secret, which every server RPC but health needs (common/trust.py)


@contextmanager
def local_stack(config: EngineConfig, device: str, max_inflight: int, num_prefill: int = 1,
                prefill_policy: str = "round_robin", torch_threads: int = 0,
                router_workers: int = 1) -> Iterator[LocalStack]:
    """Start a router, a decode server and `num_prefill` prefill servers, wait until all are
    routable, yield where they listen (`prefill`: the first prefill server); stop them at the end.
    `torch_threads` > 0 is each server's --torch-threads (0: torch's default). `router_workers` is
    the router's --workers (1, the default here: one process, whose CPU time router_pid measures)."""
    py = sys.executable
    decode_config, prefill_configs = memory_split(config, device, num_prefill)
    one_gpu = decode_config is not prefill_configs[0]  # each server sizes itself after the ones before
    decode, router = free_port(), free_port()
    prefills = [free_port() for _ in range(num_prefill)]
    base = f"http://127.0.0.1:{router}"
    procs: list[subprocess.Popen] = []

    threads = ["--torch-threads", str(torch_threads)] if torch_threads > 0 else []
    # A fresh cluster secret per run, as `pdserve up` makes one: the measured path is the secured one.
    secret_dir = tempfile.mkdtemp(prefix="pdserve-bench-")
    secret_file = write_secret_file(secret_dir)
    secret = ["--cluster-secret-file", secret_file]

    def server(role: str, cfg: EngineConfig, port: int) -> None:
        procs.append(subprocess.Popen([py, "-m", f"pdserve.{role}.cli", *engine_flags(cfg), *threads, "--port", str(port),
                                       "--log-level", "warning", *secret]))

    try:
        procs.append(subprocess.Popen([py, "-m", "pdserve.router.cli", "--model-path", config.model_path,
                                       "--prefill", *(f"127.0.0.1:{p}" for p in prefills),
                                       "--decode", f"127.0.0.1:{decode}", "--prefill-policy", prefill_policy,
                                       "--served-model-name", config.served_model_name, "--port", str(router),
                                       "--max-inflight", str(max_inflight), "--workers", str(router_workers),
                                       "--log-level", "warning", *secret]))
        server("decode", decode_config, decode)
        if one_gpu:
            _wait_until(base, procs, lambda state: bool(state.get("decode")), "the decode server")
        for i, (cfg, port) in enumerate(zip(prefill_configs, prefills)):
            server("prefill", cfg, port)
            if one_gpu:
                _wait_until(base, procs, lambda state, n=i + 1: len(state.get("prefill") or ()) >= n, f"prefill server {i}")
        _wait_until(base, procs, lambda state: state.get("ready") is True and len(state["prefill"]) == num_prefill,
                    "the local stack")
        print(f"local stack up: router {base}, prefill {' '.join(f':{p}' for p in prefills)}, decode :{decode}",
              flush=True)
        yield LocalStack(base, f"127.0.0.1:{prefills[0]}", f"127.0.0.1:{decode}", router_pid=procs[0].pid,
                         cluster_secret_file=secret_file)
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)  # the servers drain, the router stops
        for p in procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        shutil.rmtree(secret_dir, ignore_errors=True)


def _readiness(base: str) -> dict:
    """The router's /readiness body ({"ready", "prefill": [...], "decode": [...]}, 503 until ready)."""
    try:
        with urllib.request.urlopen(base + "/readiness", timeout=2) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        try:
            return json.loads(e.read())
        except ValueError:
            return {}
    except (OSError, ValueError):
        return {}


def _wait_until(base: str, procs: list[subprocess.Popen], done: Callable[[dict], bool], what: str) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"{' '.join(p.args[:3])} exited with code {p.returncode} before {what} was ready")
        if done(_readiness(base)):
            return
        time.sleep(0.3)
    raise TimeoutError(f"{what} not ready after {READY_TIMEOUT_S} s")
