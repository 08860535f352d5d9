"""A server's grammar worker forked at the start of its scheduler process, torch already imported.

    prefork(main, threads)  # run_scheduler, while the process has one thread: the worker forks now
    take()                  # (process, connection) for GrammarWorker to adopt, or None

Why: spawned (`python -m ...grammar_worker`), each grammar worker starts an interpreter and imports
torch, because xgrammar does (its matcher module, at import): on the 2-core CPU box ~2.5 s of CPU
each, for two servers ~5 s of a `pdserve up` that is bound by its CPU (docs/benchmarks/
startup-and-small-models.md). Forked from the scheduler process right after its own imports, the
worker has torch and transformers already and imports only xgrammar.

NOTE when it is safe: fork copies only the calling thread, so a child of a process whose other threads
hold a lock (zmq's I/O threads, gRPC's, the model's loading) may wait on it forever. `prefork` runs
before the scheduler process starts any thread of its own and checks that Python has none
(threading); the native thread pools already there by then are made for it: numpy's OpenBLAS stops its
threads before a fork (pthread_atfork) and torch makes its OpenMP pool at its first parallel op. The
same holds for PyTorch's DataLoader, which forks after `import torch` on Linux by default. CUDA is
initialized later, by the engine, and never in the worker. Where Python threads run already,
`prefork` does nothing and the worker is spawned as before (GrammarWorker). The worker dies with the
scheduler's main thread (PR_SET_PDEATHSIG), which lives as long as the process.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from multiprocessing.connection import Connection

logger = logging.getLogger(__name__)

_forked: tuple["ForkedProcess", Connection] | None = None


class ForkedProcess:
    """The forked worker, as GrammarWorker uses a subprocess.Popen: poll, wait, kill, returncode."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"grammar worker {self.pid}", timeout)
            time.sleep(0.01)
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:  # (exited since, not yet reaped)
                pass


def prefork(main: Callable[[dict], None], threads: int) -> bool:
    """Fork the grammar worker now: the child runs `main` (grammar_worker.main) with a socket to this
    process and `threads` fill threads. False, and nothing done, when this process runs other Python
    threads already."""
    global _forked
    if _forked is not None:
        return True
    if threading.active_count() != 1:
        logger.info("the grammar worker will be spawned: this process runs other threads already")
        return False
    ours, theirs = socket.socketpair()
    parent = os.getpid()
    with warnings.catch_warnings():
        # (Python 3.12+ warns of any thread, the native pools above included)
        warnings.filterwarnings("ignore", message=".*use of fork.*", category=DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # the worker: it never returns from here
        code = 1
        try:
            ours.close()
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # (the scheduler's SystemExit handler is not ours)
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the scheduler's to handle: it closes us
            main({"parent": parent, "fd": theirs.detach(), "threads": threads, "forked": True})
            code = 0
        except BaseException:  # noqa: BLE001 - said on stderr; the parent sees the exit
            traceback.print_exc()
        finally:
            os._exit(code)  # NOTE never the parent's atexit hooks or finalizers: they are its
    theirs.close()
    _forked = (ForkedProcess(pid), Connection(ours.detach()))
    return True


def take() -> tuple[ForkedProcess, Connection] | None:
    """The forked worker for a GrammarWorker to adopt (once), or None."""
    global _forked
    forked, _forked = _forked, None
    return forked
