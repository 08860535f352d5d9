"""Servers that share a GPU run side by side, not time-sliced: a private NVIDIA MPS control daemon.

Two CUDA processes on one GPU time-slice it: each runs alone for its slice, so a prefill server's
kernels wait while the decode server holds the GPU (measured on an H200, GPT-2 shape, 1024 prompts
at once: 12.2k output tok/s served against 66.1k under MPS; docs/benchmarks/one-gpu.md, "One GPU"). Under
MPS the processes are clients of one MPS server, and their kernels run on the GPU at the same time.

    sharing = GpuSharing.start(plan, run_dir, mode, shares)   # a daemon only if a GPU holds 2+ servers
    env = sharing.server_env(server, visible)                  # the server's whole environment
    sharing.stop()                                             # on every exit path, once the servers are gone

The daemon is this launcher's own: its pipe and log directories are under the run directory
(CUDA_MPS_PIPE_DIRECTORY, CUDA_MPS_LOG_DIRECTORY), it runs in the foreground as our child in a
session of its own (a Ctrl-C meant for the servers must not stop it under them), it dies with the
launcher (PR_SET_PDEATHSIG), and it is told to quit once the servers are gone. Nothing about the GPU
is changed: no compute mode, clocks or other setting; a client finds the daemon through its pipe
directory alone.

Each server on a shared GPU gets an SM share, CUDA_MPS_ACTIVE_THREAD_PERCENTAGE: the most of the
GPU's SMs its kernels may occupy (100: no cap). Caps leave SMs free for the other role's kernels, but
a fixed cap also starves a role whose load comes in bursts (prefill capped at 35% served a 1024-prompt
burst at 43.4k tok/s against 66.1k uncapped on an H200): docs/benchmarks/README.md has the measured default.

NOTE the daemon remaps devices: its MPS server sees the GPUs this launcher sees, numbered from 0, so
a client's CUDA_VISIBLE_DEVICES holds the launcher's own GPU numbers, not the names the launcher was
given (NVIDIA's MPS documentation, "CUDA_VISIBLE_DEVICES").
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from typing import NamedTuple, Sequence

from pdserve.common.lifetime import parent_death_signal_setter
from pdserve.router.placement import ServerPlacement, server_env

CONTROL = "nvidia-cuda-mps-control"
MODES = ("auto", "on", "off")
START_TIMEOUT_S = 10.0  # for the daemon's control pipe to appear
QUIT_TIMEOUT_S = 10.0  # for the daemon to exit once told to quit
# What two servers on one GPU lose without MPS (the measurement in this module's docstring).
TIME_SLICED_COST = (
    "served 5.4x less than under MPS (12.2k vs 66.1k output tok/s, H200, GPT-2, docs/benchmarks/one-gpu.md)"
)


class SMShares(NamedTuple):
    """Percent of a shared GPU's SMs each role's server may occupy (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE)."""

    prefill: int
    decode: int

    def of(self, role: str) -> int:
        return self.prefill if role == "prefill" else self.decode

    def __str__(self) -> str:
        return f"{self.prefill}:{self.decode}"


# Measured on an H200 (docs/benchmarks/one-gpu.md, "The mixed and decode-heavy slices at SM splits"): prefill
# capped at 50% of the SMs doubled the pair's goodput on the mixed slice (>= 128 req/s against 64), took
# the prefill-heavy one from < 40 to >= 56 req/s and cost the decode-heavy one nothing; uncapped, a
# prefill's GEMMs take every SM while they run and decode steps wait behind them.
DEFAULT_SM_SHARES = SMShares(prefill=50, decode=100)


def parse_sm_shares(value: str) -> SMShares:
    """`--sm-shares PREFILL:DECODE`, percentages in 1..100 (e.g. 100:100, 60:100)."""
    parts = value.split(":")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"--sm-shares takes PREFILL:DECODE percentages (e.g. 100:100 or 60:100), got {value!r}")
    shares = SMShares(int(parts[0]), int(parts[1]))
    for role, pct in zip(SMShares._fields, shares):
        if not 1 <= pct <= 100:
            raise ValueError(f"--sm-shares: the {role} share must be 1-100 (percent of the GPU's SMs), got {pct}")
    return shares


def shared_gpus(plan: Sequence[ServerPlacement]) -> set[int]:
    """The GPUs that hold two or more of the plan's servers."""
    seen, shared = set(), set()
    for server in plan:
        for g in server.gpus:
            (shared if g in seen else seen).add(g)
    return shared


class MPSUnavailable(RuntimeError):
    """The MPS control daemon could not be started; the message says why."""


def _control_env(base: dict[str, str], pipe_dir: str, log_dir: str) -> dict[str, str]:
    env = {k: v for k, v in base.items() if not k.startswith("CUDA_MPS_")}
    env["CUDA_MPS_PIPE_DIRECTORY"] = pipe_dir
    env["CUDA_MPS_LOG_DIRECTORY"] = log_dir
    return env


class MPSDaemon:
    """A running private MPS control daemon (`nvidia-cuda-mps-control -f`, our child)."""

    def __init__(self, process: subprocess.Popen, control: str, pipe_dir: str, log_dir: str):
        self.process, self.control, self.pipe_dir, self.log_dir = process, control, pipe_dir, log_dir

    @classmethod
    def start(cls, run_dir: str, control: str | None = None, timeout_s: float = START_TIMEOUT_S) -> "MPSDaemon":
        control = control or shutil.which(CONTROL)
        if control is None:
            raise MPSUnavailable(f"{CONTROL} is not on PATH (it ships with the NVIDIA driver's utilities)")
        pipe_dir, log_dir = os.path.join(run_dir, "mps-pipe"), os.path.join(run_dir, "mps-log")
        os.makedirs(pipe_dir, mode=0o700, exist_ok=True)
        os.makedirs(log_dir, mode=0o700, exist_ok=True)
        env = _control_env(dict(os.environ), pipe_dir, log_dir)
        # Semi-PD's setting: each client context gets the SM share it asks for.
        env["CUDA_MPS_ENABLE_PER_CTX_DEVICE_MULTIPROCESSOR_PARTITIONING"] = "1"
        launcher, die_with_launcher = os.getpid(), parent_death_signal_setter(signal.SIGTERM)

        def in_child() -> None:  # (between fork and exec: no imports, no allocation worth the name)
            die_with_launcher()
            if os.getppid() != launcher:
                os._exit(1)

        with open(os.path.join(log_dir, "control-stdout.log"), "ab") as out:
            process = subprocess.Popen(
                [control, "-f"],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=in_child,
            )
        daemon = cls(process, control, pipe_dir, log_dir)
        deadline = time.monotonic() + timeout_s
        while not os.path.exists(os.path.join(pipe_dir, "control")):
            if process.poll() is not None:
                raise MPSUnavailable(
                    f"{CONTROL} exited with code {process.returncode} at start ({daemon.log_tail() or 'no log'})"
                )
            if time.monotonic() > deadline:
                daemon.stop()
                raise MPSUnavailable(f"{CONTROL} made no control pipe in {pipe_dir} within {timeout_s:.0f} s")
            time.sleep(0.05)
        return daemon

    def client_env(self, sm_percent: int) -> dict[str, str]:
        """What a client adds to its environment to run under this daemon with an SM share."""
        env = {"CUDA_MPS_PIPE_DIRECTORY": self.pipe_dir, "CUDA_MPS_LOG_DIRECTORY": self.log_dir}
        if sm_percent < 100:
            env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(sm_percent)
        return env

    def stop(self) -> None:
        """Tell the daemon to quit (its MPS server goes with it); kill it if it has not within
        QUIT_TIMEOUT_S. Call once the servers are gone: a client still running loses its GPU."""
        if self.process.poll() is None:
            try:
                subprocess.run(
                    [self.control],
                    input=b"quit\n",
                    env=_control_env(dict(os.environ), self.pipe_dir, self.log_dir),
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    timeout=QUIT_TIMEOUT_S,
                    check=False,
                )
            except (OSError, subprocess.TimeoutExpired):
                pass
        try:
            self.process.wait(QUIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def log_tail(self, lines: int = 3) -> str:
        text = ""
        for name in ("control.log", "control-stdout.log"):
            try:
                with open(os.path.join(self.log_dir, name), errors="replace") as f:
                    text += f.read()
            except OSError:
                pass
        return " | ".join(line.strip() for line in text.strip().splitlines()[-lines:])


@dataclass
class GpuSharing:
    """How the servers of one plan share their GPUs: under `daemon` (None: no GPU is shared, MPS is
    off, or it could not be had: then `unavailable` says why), with `shares` on the shared GPUs."""

    shared: set[int]
    shares: SMShares
    daemon: MPSDaemon | None = None
    unavailable: str = ""

    @classmethod
    def start(
        cls,
        plan: Sequence[ServerPlacement],
        run_dir: str,
        mode: str = "auto",
        shares: SMShares = DEFAULT_SM_SHARES,
        control: str | None = None,
    ) -> "GpuSharing":
        """A daemon when a GPU holds two of the plan's servers and `mode` allows: auto (MPS where it
        can be had, else `unavailable` says why), on (MPS or MPSUnavailable), off (never). The
        caller stops it (`stop`) on every exit path."""
        if mode not in MODES:
            raise ValueError(f"--mps must be one of {', '.join(MODES)}, got {mode!r}")
        sharing = cls(shared_gpus(plan), shares)
        if sharing.shared and mode != "off":
            try:
                sharing.daemon = MPSDaemon.start(run_dir, control)
            except MPSUnavailable as e:
                if mode == "on":
                    raise
                sharing.unavailable = str(e)
        return sharing

    def server_env(self, server: ServerPlacement, visible: list[str]) -> dict[str, str]:
        """The server's whole environment: its GPUs visible, and on a shared GPU under the daemon
        its MPS pipe and SM share (its GPUs then numbered as this launcher numbers them)."""
        env = server_env(server, visible)
        if self.daemon is not None and self.shared & set(server.gpus):
            env = {k: v for k, v in env.items() if not k.startswith("CUDA_MPS_")}
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, server.gpus))  # (the daemon's numbering: NOTE above)
            env.update(self.daemon.client_env(self.shares.of(server.role)))
        return env

    def describe(self) -> str:
        """One line for the start-up print."""
        if not self.shared:
            return "GPU sharing: none (each server has its GPUs to itself)"
        gpus = ",".join(map(str, sorted(self.shared)))
        if self.daemon is None:
            why = f"MPS cannot be had: {self.unavailable}" if self.unavailable else "--mps off"
            return f"GPU sharing: GPU {gpus} time-sliced ({why}); that costs: {TIME_SLICED_COST}"
        return (
            f"GPU sharing: MPS on GPU {gpus} (a private daemon, pipe {self.daemon.pipe_dir}); "
            f"SM shares prefill {self.shares.prefill}%, decode {self.shares.decode}%"
        )

    def stop(self) -> None:
        if self.daemon is not None:
            self.daemon.stop()
            self.daemon = None
