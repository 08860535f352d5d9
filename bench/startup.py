"""How long `pdserve up` takes to serve, and where each server's start-up goes, over repeated starts.

    python3 -m pdserve.bench.startup [--model-path PATH] [--starts 3] [-- any other `pdserve up` flags]

Each start is a fresh `pdserve up --device auto` (what a plain `pdserve up` runs: the GPUs when there
are, else the CPU; `--device cpu` / `cuda` to choose; the default model without --model-path) on a free
port, stopped with Ctrl-C once it prints that it is up. Printed per start: "is up after" (the command's
own clock), then the median over the starts of each engine's phases (the servers' "Engine started"
lines: imports, tokenizer, weights, ...). The first start fills the host caches (converted tokenizer,
parsed GGUF metadata: common/cache.py); run once before timing to measure a warm host.
"""

from __future__ import annotations

import argparse
import re
import signal
import statistics
import subprocess
import sys
import time

from pdserve.common.ports import free_port

UP = re.compile(r"pdserve is up after ([\d.]+) s")
PHASES = re.compile(r"(\w+)Engine started: (.*), total ([\d.]+) s")
START_TIMEOUT_S = 300.0


def one_start(flags: list[str], device: str = "cpu") -> tuple[float, dict[str, dict[str, float]]]:
    """(seconds until up, {engine: {phase: seconds}}) for one `pdserve up` run with `flags`."""
    cmd = [sys.executable, "-m", "pdserve.common.cli", "up", "--device", device, "--port", str(free_port()), *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    engines: dict[str, dict[str, float]] = {}
    deadline = time.monotonic() + START_TIMEOUT_S
    try:
        for line in proc.stdout:  # (the deadline is checked per line: a start prints as it goes)
            if (m := PHASES.search(line)) is not None:
                phases = dict(part.rsplit(" ", 2)[:2] for part in m.group(2).split(", "))
                engines[m.group(1)] = {k: float(v) for k, v in phases.items()} | {"total": float(m.group(3))}
            if (m := UP.search(line)) is not None:
                return float(m.group(1)), engines
            if time.monotonic() > deadline:
                break
        raise RuntimeError(f"pdserve up did not come up (exit code {proc.poll()}): {' '.join(cmd)}")
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m pdserve.bench.startup", description=__doc__.split("\n")[0])
    parser.add_argument("--model-path", default=None, help="default: pdserve up's default model")
    parser.add_argument("--starts", type=int, default=3)
    parser.add_argument("--device", default="auto", help="pdserve up's --device (auto, cpu, cuda).")
    args, rest = parser.parse_known_args(argv)
    flags = (["--model-path", args.model_path] if args.model_path else []) + [f for f in rest if f != "--"]
    ups, runs = [], []
    for n in range(args.starts):
        up, engines = one_start(flags, args.device)
        ups.append(up)
        runs.append(engines)
        print(f"start {n + 1}: up after {up:.1f} s", flush=True)
    print(f"median: up after {statistics.median(ups):.1f} s ({min(ups):.1f}-{max(ups):.1f})")
    for engine in sorted(runs[-1]):
        phases = runs[-1][engine]
        medians = {p: statistics.median(r[engine][p] for r in runs if engine in r) for p in phases}
        print(f"  {engine}: " + ", ".join(f"{p} {s:.1f} s" for p, s in medians.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
