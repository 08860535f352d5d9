"""`bench serve` without --base-url: a local router + prefill and decode servers, placed on the GPUs
and started as `pdserve up` does (servers sharing a GPU under a private MPS daemon:
router/gpu_sharing.py), but with the benchmark's engine flags (so --disable-overlap-schedule and
friends apply) and the layout as given.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from typing import Callable, Iterator

from pdserve.common.config import DEFAULT_MEM_FRACTION_STATIC, EngineConfig
from pdserve.common.lifetime import parent_death_signal_setter
from pdserve.common.ports import free_port
from pdserve.common.trust import write_secret_file
from pdserve.router.gpu_sharing import DEFAULT_SM_SHARES, GpuSharing, SMShares, parse_sm_shares
from pdserve.router.placement import (
    ServerPlacement,
    describe,
    plan_placement,
    rank_threads,
    resolve_gpus,
    usable_cores,
    visible_gpu_names,
)
from pdserve.router.up import READY_TIMEOUT_S, start_servers, stop_processes


def sm_shares_of(args) -> SMShares:
    """`bench serve --sm-shares` as SMShares (auto: the measured default, router/gpu_sharing.py)."""
    return DEFAULT_SM_SHARES if args.sm_shares == "auto" else parse_sm_shares(args.sm_shares)


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


def server_configs(
    config: EngineConfig,
    plan: list[ServerPlacement],
    device: str,
    tp_of: dict[str, int],
    decode_max_total_tokens: int = 0,
) -> list[EngineConfig]:
    """Each planned server's config: its role's TP size, the device kind (it sees only its own GPUs:
    rank r on cuda:r) and its --mem-fraction-static from the plan, unless the KV cache is sized
    explicitly (--max-total-tokens, --kv-cache-memory-gb apply to each server as given;
    `decode_max_total_tokens` > 0, `bench serve --decode-max-total-tokens`, to the decode servers instead)."""
    configs = []
    for server in plan:
        cfg = dataclasses.replace(config, device=device, tp_size=tp_of[server.role])
        if server.role == "decode" and decode_max_total_tokens:
            cfg = dataclasses.replace(cfg, max_total_tokens=decode_max_total_tokens)
        if server.gpus and not (cfg.max_total_tokens or cfg.kv_cache_memory_gb):
            cfg = dataclasses.replace(cfg, mem_fraction_static=server.mem_fraction)
        configs.append(cfg)
    return configs


@dataclasses.dataclass(frozen=True)
class LocalStack:
    base_url: str  # the router's
    prefill: str | None  # HOST:PORT of the (first) prefill server's gRPC service (None: none, --disagg-policy never)
    decode: str  # HOST:PORT of the (first) decode server's
    router_pid: int = 0  # the router's process, for its CPU time (with router_workers > 1: the supervisor's only)
    cluster_secret_file: str = ""  # the run's secret, which every server RPC but health needs (common/trust.py)


@contextmanager
def local_stack(
    config: EngineConfig,
    device: str,
    max_inflight: int,
    num_prefill: int = 1,
    prefill_policy: str = "round_robin",
    torch_threads: int = 0,
    router_workers: int = 1,
    num_decode: int = 1,
    prefill_tp: int = 0,
    decode_tp: int = 0,
    gpus: str | None = None,
    disagg_policy: str = "always",
    mps: str = "auto",
    sm_shares: SMShares = DEFAULT_SM_SHARES,
    decode_max_total_tokens: int = 0,
) -> Iterator[LocalStack]:
    """Start `num_decode` decode servers, `num_prefill` prefill servers and a router, placed as
    `pdserve up` places them (router/placement.py; `gpus`: --gpus as given, None: every visible
    GPU), wait until all are routable, yield where they listen; stop them at the end.
    `device`: the resolved --device. `prefill_tp` / `decode_tp`: each role's --tp-size (0: the
    config's). `torch_threads` > 0 is each server's --torch-threads (0: torch's default, but a TP
    server on CPU gets the cores split among all local ranks). `router_workers` is the router's
    --workers (1, the default here: one process, whose CPU time router_pid measures);
    `disagg_policy` its --disagg-policy (`never` runs with no prefill server). `mps`, `sm_shares`:
    how servers sharing a GPU run (`pdserve up --mps --sm-shares`). `decode_max_total_tokens` > 0: the
    decode servers' KV pool in tokens (server_configs)."""
    py = sys.executable
    tp_of = {"prefill": prefill_tp or config.tp_size, "decode": decode_tp or config.tp_size}
    visible = visible_gpu_names() if device != "cpu" else []
    device, placed_on = resolve_gpus(device, gpus, visible)
    fraction = config.mem_fraction_static or DEFAULT_MEM_FRACTION_STATIC
    plan = plan_placement(placed_on, num_prefill, tp_of["prefill"], num_decode, tp_of["decode"], fraction)
    configs = dict(zip(plan, server_configs(config, plan, device, tp_of, decode_max_total_tokens)))
    rank_share = rank_threads(num_prefill * tp_of["prefill"] + num_decode * tp_of["decode"], usable_cores())
    router = free_port()
    base = f"http://127.0.0.1:{router}"
    procs: list[subprocess.Popen] = []
    # SIGTERM (`timeout`, a job runner) stops the stack as Ctrl-C does: Python's default would end this
    # process at once, skipping the `finally` below, and the next stack would start beside servers still
    # holding the GPU's memory (and the MPS daemon).
    on_term = (
        signal.signal(signal.SIGTERM, _interrupt) if threading.current_thread() is threading.main_thread() else None
    )

    # A fresh cluster secret per run, as `pdserve up` makes one: the measured path is the secured one.
    run_dir = tempfile.mkdtemp(prefix="pdserve-bench-")
    secret_file = write_secret_file(run_dir)
    secret = ["--cluster-secret-file", secret_file]

    def command(server: ServerPlacement, port: int) -> list[str]:
        threads = torch_threads
        if not threads and not server.gpus and tp_of[server.role] > 1:
            threads = rank_share  # the ranks must not fight over the cores (router/placement.py)
        flags = ["--torch-threads", str(threads)] if threads > 0 else []
        return [
            py,
            "-m",
            f"pdserve.{server.role}.cli",
            *engine_flags(configs[server]),
            *flags,
            "--port",
            str(port),
            "--log-level",
            "warning",
            "--disable-grammar-warmup",  # (the benchmarks send no grammar: no worker started for one)
            *secret,
        ]

    sharing = None
    try:
        sharing = GpuSharing.start(plan, run_dir, mps, sm_shares)
        print(
            "local stack placement:\n" + "\n".join(describe(plan, tp_of, visible)) + "\n" + sharing.describe(),
            flush=True,
        )
        servers = start_servers(plan, command, lambda server: sharing.server_env(server, visible), procs, run_dir)
        prefill_flags = ["--prefill", *servers["prefill"]] if servers["prefill"] else []
        procs.append(
            subprocess.Popen(
                [
                    py,
                    "-m",
                    "pdserve.router.cli",
                    "--model-path",
                    config.model_path,
                    *prefill_flags,
                    "--decode",
                    *servers["decode"],
                    "--prefill-policy",
                    prefill_policy,
                    "--disagg-policy",
                    disagg_policy,
                    "--served-model-name",
                    config.served_model_name,
                    "--port",
                    str(router),
                    "--max-inflight",
                    str(max_inflight),
                    "--workers",
                    str(router_workers),
                    "--log-level",
                    "warning",
                    *secret,
                ],
                preexec_fn=parent_death_signal_setter(signal.SIGTERM),  # (the servers' too: router/up.py)
            )
        )
        _wait_until(
            base,
            procs,
            lambda state: (
                state.get("ready") is True
                and len(state["prefill"]) == num_prefill
                and len(state["decode"]) == num_decode
            ),
            "the local stack",
        )
        print(
            f"local stack up: router {base}, prefill {' '.join(servers['prefill'])}, "
            f"decode {' '.join(servers['decode'])}",
            flush=True,
        )
        yield LocalStack(
            base,
            (servers["prefill"] or [None])[0],
            servers["decode"][0],
            router_pid=procs[-1].pid,
            cluster_secret_file=secret_file,
        )
    finally:
        stop_processes(procs)  # the servers drain, the router stops
        if sharing is not None:
            sharing.stop()  # after the servers (router/gpu_sharing.py)
        shutil.rmtree(run_dir, ignore_errors=True)
        if on_term is not None:
            signal.signal(signal.SIGTERM, on_term)


def _interrupt(*_) -> None:
    raise KeyboardInterrupt


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
