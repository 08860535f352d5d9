"""A router process's memory and start time, and whether torch is in it.

    python -m pdserve.bench.micro.router_memory [--model-path PATH] [--workers 1 4] [--starts 3]

Starts `pdserve-router --workers N` (no servers: it is asked for a decode server on a port nobody
listens on, which a start does not need) and times it from launch to /readiness saying
`router_started` (every worker serving, the warm spare built). Then reads, from /proc, every process
of the router (the supervisor, its fork server, workers and spare): its resident memory (VmRSS), its
proportional share (Pss: forked workers share their fork server's pages, which RSS counts in each),
and whether it maps torch's library. Without --model-path: a tiny llama made by make-tiny-model.
Prints a table per start and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from pdserve.common.ports import free_port


def process_tree(root: int) -> list[int]:
    """`root` and its descendants (children listed by /proc/PID/task/*/children)."""
    found, queue = [], [root]
    while queue:
        pid = queue.pop(0)
        found.append(pid)
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                queue += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass  # gone meanwhile
    return found


def memory_of(pid: int) -> dict:
    """name, VmRSS and Pss in MB, and whether libtorch is mapped."""
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    rollup = Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
    pss_kb = next(int(line.split()[1]) for line in rollup if line.startswith("Pss:"))
    return {
        "pid": pid,
        "name": status["Name"].strip(),
        "rss_mb": round(int(status["VmRSS"].split()[0]) / 1024, 1),
        "pss_mb": round(pss_kb / 1024, 1),
        "torch": "libtorch" in Path(f"/proc/{pid}/maps").read_text(),
    }


def started(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/readiness", timeout=2) as r:
            body = r.read()
    except urllib.error.HTTPError as e:  # 503 until a decode server is healthy: none will be
        body = e.read()
    except OSError:
        return False
    return bool(json.loads(body).get("router_started"))


def one_start(model: str, workers: int, timeout_s: float) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "pdserve.router.cli", "--model-path", model, "--port", str(port)]
    argv += [
        "--decode",
        f"127.0.0.1:{free_port()}",
        "--disagg-policy",
        "never",
        "--workers",
        str(workers),
        "--log-level",
        "warning",
    ]
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while not started(url):
            if proc.poll() is not None or time.monotonic() - t0 > timeout_s:
                raise RuntimeError(f"router not started (exit code {proc.poll()}): {' '.join(argv)}")
            time.sleep(0.05)
        ready_s = time.monotonic() - t0
        return {"ready_s": round(ready_s, 2), "processes": [memory_of(pid) for pid in process_tree(proc.pid)]}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", default="", help="checkpoint directory or GGUF file (default: a tiny llama)")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 4], help="router worker counts, one run each")
    p.add_argument("--starts", type=int, default=3, help="starts per worker count")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds a start may take")
    args = p.parse_args(argv)
    model = args.model_path
    if not model:
        from pdserve.common.tiny_model import make_tiny_model

        model = str(make_tiny_model(Path(tempfile.mkdtemp()) / "llama", "llama", seed=0))
    runs = []
    for workers in args.workers:
        for start in range(args.starts):
            run = {"workers": workers, "start": start, **one_start(model, workers, args.timeout)}
            runs.append(run)
            print(f"--workers {workers}, start {start}: started in {run['ready_s']} s")
            for m in run["processes"]:
                memory = f"RSS {m['rss_mb']:>6} MB  PSS {m['pss_mb']:>6} MB"
                print(f"  {m['name']:<16} pid {m['pid']:>7}  {memory}  torch {m['torch']}")
    print(json.dumps({"model": model, "command": sys.argv, "runs": runs}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
