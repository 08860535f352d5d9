"""Where a server's start-up time goes: the engine marks each phase as it ends.

    clock = StartupClock(report_path)     (report_path "": no file)
    clock.mark("weights")                 the phase since the last mark (or since the clock began)
    clock.summary()                       "weights 1.2 s, kv_pool 0.3 s, ..., total 9.8 s"

With a report file (a server's --startup-report, which `pdserve up` gives each server it starts),
every mark is also appended to it as one JSON line {"phase", "seconds", "at"} (`at`: seconds since
the clock began) as soon as it ends: the launcher reads the file to learn that a server sharing a GPU
has measured its memory and allocated its KV pool (phase KV_POOL), after which the next server on
that GPU may start measuring its own (router/up.py). Host-only: no torch here, so the launcher
imports it too.
"""

from __future__ import annotations

import json
import os
import time

KV_POOL = "kv_pool"  # the KV pool is allocated: the GPU memory this server measured is taken
READY = "ready"  # the engine is built (the last mark a scheduler makes)


class StartupClock:
    def __init__(self, report_path: str = "", gpu_after: str = "", timeout_s: float = 300.0):
        """`gpu_after`: another server's report file; `before_gpu` waits until that server has
        allocated its KV pool (at most `timeout_s`). The clock begins when this process began, so
        the first phase counts the interpreter's start and the imports before the clock existed."""
        self.report_path, self.gpu_after, self.timeout_s = report_path, gpu_after, timeout_s
        self.phases: dict[str, float] = {}
        self._began = time.perf_counter() - process_age()
        self._last = self._began  # (the first phase from the process's start: it was missing from the breakdown)

    def before_gpu(self) -> None:
        """Called by the engine before its first use of the GPU: with `gpu_after`, wait (phase
        "gpu_wait") until that server's KV pool is allocated, so that the memory this server measures
        in use holds the other's weights and KV cache but none of this one's own, whichever started
        first (router/up.py starts servers sharing a GPU together)."""
        if not self.gpu_after:
            return
        deadline = time.monotonic() + self.timeout_s
        while not any(p["phase"] in (KV_POOL, READY) for p in read_phases(self.gpu_after)):
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the server writing {self.gpu_after} allocated no KV pool in {self.timeout_s:.0f} s"
                )
            time.sleep(0.05)
        self.mark("gpu_wait")

    def mark(self, phase: str) -> float:
        """End `phase` now; its seconds (a phase marked twice adds up)."""
        now = time.perf_counter()
        seconds = now - self._last
        self._last = now
        self.phases[phase] = self.phases.get(phase, 0.0) + seconds
        if self.report_path:
            line = json.dumps({"phase": phase, "seconds": round(seconds, 3), "at": round(now - self._began, 3)})
            with open(self.report_path, "a", encoding="utf-8") as f:
                f.write(line + "\n")
        return seconds

    @property
    def total(self) -> float:
        return self._last - self._began

    def summary(self) -> str:
        parts = [f"{phase} {seconds:.1f} s" for phase, seconds in self.phases.items()]
        return ", ".join(parts + [f"total {self.total:.1f} s"])


def process_age() -> float:
    """Seconds since this process began (Linux: /proc; elsewhere 0)."""
    try:
        with open("/proc/self/stat") as f:
            started_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - started_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


def read_phases(report_path: str) -> list[dict]:
    """The phases a report file holds so far, in order ([] when there is no file yet). A line still
    being written (no newline yet) is left for the next read."""
    try:
        with open(report_path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.split("\n")[:-1] if line.strip()]


def uncached_bytecode_hint(package: str = "torch") -> str:
    """A line for `pdserve up` when every server process compiles `package`'s Python source at start: the
    package holds no bytecode and Python may not write any (PYTHONDONTWRITEBYTECODE, a read-only install);
    "" otherwise. On an H200 host set up that way each server's imports took 3.2-4.3 s, 1.5-1.8 s once
    compiled (docs/benchmarks/startup-and-small-models.md). Found without importing the package."""
    import importlib.util
    import sys

    spec = importlib.util.find_spec(package)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return ""
    cached = importlib.util.cache_from_source(spec.origin)
    where = os.path.dirname(spec.origin)
    if os.path.exists(cached) or (not sys.dont_write_bytecode and os.access(where, os.W_OK)):
        return ""
    return (
        f"note: {package} has no compiled bytecode here and Python writes none, so each server compiles it at every "
        f"start (~2 s): `python -m compileall -q {where}` once (or install with `uv pip install --compile-bytecode`)"
    )
