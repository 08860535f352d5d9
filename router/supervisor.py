"""`pdserve-router --workers N` (N > 1): N worker processes serve one port; this process keeps them.

- The port is bound once here and let go before any worker starts: a port in use is an immediate
  error, not N workers failing one after another.
- Each worker (router/serve.py) binds --host/--port with SO_REUSEPORT and runs its own Router: its
  own gRPC channels, health checks, circuit breakers and policies (router/policies.py says how
  each policy behaves across processes).
- /metrics, in any worker, reports all of them: prometheus_client's multiprocess mode, in a fresh
  directory made here and removed at exit (router/metrics.py).
- A worker that dies is started again at once. A worker that dies before it serves is a failed
  start: at the first start that ends the router (everything runs the same flags, so the next
  try fails alike: a bad --model-path, say); later, MAX_FAILED_STARTS in a row of one worker do.
- SIGTERM and SIGINT are passed on to the workers as SIGTERM (uvicorn drains their connections),
  and this process exits 0 when they are gone; a SIGINT after that is passed on as SIGINT,
  uvicorn's "stop now".

NOTE: workers are spawned, never forked: a forked child would inherit the parent's threads' locks
(grpc's, the tokenizer's) in whatever state they were.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess

from pdserve.router.config import RouterConfig
from pdserve.router.serve import bind, run_worker

log = logging.getLogger(__name__)

MAX_FAILED_STARTS = 5  # in a row, of one worker, once the router has served
STOP_TIMEOUT_S = 10.0  # after a failed start: how long the other workers get before SIGKILL


@dataclass
class Worker:
    """One worker slot: its current process and the pipe it says "ready" on."""

    index: int
    process: BaseProcess
    ready: Connection  # read end
    serving: bool = False  # said ready
    exited: bool = False  # death seen and handled
    failed_starts: int = 0  # consecutive deaths before serving, of this slot


def describe_exit(code: int) -> str:
    return f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"


class Supervisor:
    def __init__(self, config: RouterConfig, target=run_worker):
        """`target(config, index, ready_connection, metrics_dir)` is what a worker process runs (tests swap it)."""
        self.config = config
        self.target = target
        self.context = multiprocessing.get_context("spawn")
        self.workers: list[Worker] = []
        self.received: list[int] = []  # SIGTERM/SIGINT not yet passed on
        self.stopping = False
        self.all_served = False  # every slot has served once: the first start is over
        self.metrics_dir = ""

    def run(self) -> int:
        """Start the workers, keep them, stop them; the exit code."""
        try:
            bind(self.config.host, self.config.port, reuse_port=False).close()
        except OSError as e:
            print(f"error: cannot listen on {self.config.host}:{self.config.port}: {e.strerror or e}", file=sys.stderr)
            return 2
        self.metrics_dir = tempfile.mkdtemp(prefix="pdserve-router-metrics-")
        wake_read, wake_write = socket.socketpair()
        wake_write.setblocking(False)
        previous_wakeup = signal.set_wakeup_fd(wake_write.fileno())  # a signal ends wait() at once
        previous_handlers = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            self.workers = [self._start(i) for i in range(self.config.workers)]
            return self._watch(wake_read)
        finally:
            self._stop_all()
            for sig, handler in previous_handlers.items():
                signal.signal(sig, handler)
            signal.set_wakeup_fd(previous_wakeup)
            wake_read.close()
            wake_write.close()
            shutil.rmtree(self.metrics_dir, ignore_errors=True)

    def _on_signal(self, signum, frame) -> None:
        self.received.append(signum)  # the loop passes it on (no process bookkeeping inside a handler)

    def _start(self, index: int, failed_starts: int = 0) -> Worker:
        ready, ready_in_child = self.context.Pipe(duplex=False)
        process = self.context.Process(target=self.target, args=(self.config, index, ready_in_child, self.metrics_dir),
                                       name=f"pdserve-router-worker-{index}", daemon=True)
        process.start()
        ready_in_child.close()  # the child holds its own copy: our read end sees EOF when it dies
        return Worker(index, process, ready, failed_starts=failed_starts)

    def _watch(self, wake: socket.socket) -> int:
        while True:
            alive = [w for w in self.workers if not w.exited]
            if self.stopping and not alive:
                return 0
            waiting = [wake] + [w.process.sentinel for w in alive] + [w.ready for w in alive if not w.serving]
            woken = wait(waiting)
            if wake in woken:
                wake.recv(4096)
            self._forward_stop_signals()  # before the exits: a Ctrl-C reaches the workers too
            for w in alive:
                if not w.serving and w.ready in woken:
                    self._note_ready(w)
            for w in alive:
                if w.process.sentinel in woken:
                    code = self._on_exit(w)
                    if code is not None:
                        return code

    def _forward_stop_signals(self) -> None:
        """The first signal goes on as SIGTERM; a SIGINT after it as SIGINT. NOTE: uvicorn's own
        rule: a SIGINT while stopping means "now" (do not wait for open connections), a repeated
        SIGTERM means nothing — `pdserve up` sends SIGTERM after a Ctrl-C, and must not cut streams."""
        received, self.received = self.received, []
        for signum in received:
            if self.stopping and signum != signal.SIGINT:
                continue
            sig = signal.SIGINT if self.stopping else signal.SIGTERM
            if not self.stopping:
                log.info("stopping %d workers", len(self.workers))
            self.stopping = True
            for w in self.workers:
                if not w.exited:
                    try:
                        os.kill(w.process.pid, sig)
                    except ProcessLookupError:
                        pass  # exited; its sentinel says so next

    def _note_ready(self, w: Worker) -> None:
        try:
            w.ready.recv()
        except EOFError:
            return  # it died before serving: its sentinel says so
        w.serving, w.failed_starts = True, 0
        if not self.all_served and all(x.serving for x in self.workers):
            self.all_served = True
            log.info("%d workers serving http://%s:%d", len(self.workers), self.config.host, self.config.port)

    def _on_exit(self, w: Worker) -> int | None:
        """Handle the death of w's process: start it again, or say why not (the exit code)."""
        from prometheus_client.multiprocess import mark_process_dead

        w.process.join()
        w.exited = True
        w.ready.close()
        mark_process_dead(w.process.pid, self.metrics_dir)  # its live gauges (in flight, health) leave /metrics
        if self.stopping or self.received:
            return None
        how = f"worker {w.index} (pid {w.process.pid}) {describe_exit(w.process.exitcode)}"
        if not w.serving:
            w.failed_starts += 1
            if not self.all_served:
                print(f"error: router {how} while starting; stopping", file=sys.stderr)
                return w.process.exitcode if w.process.exitcode > 0 else 1
            if w.failed_starts >= MAX_FAILED_STARTS:
                print(f"error: router {how}, its {w.failed_starts}th failed start in a row; stopping", file=sys.stderr)
                return 1
        log.warning("%s; starting it again", how)
        self.workers[w.index] = self._start(w.index, w.failed_starts)
        return None

    def _stop_all(self) -> None:
        """SIGTERM what is still running, SIGKILL what outlives STOP_TIMEOUT_S (after a failure only:
        a stop asked by a signal has already waited for every worker)."""
        for w in self.workers:
            if w.process.is_alive():
                w.process.terminate()
        for w in self.workers:
            w.process.join(STOP_TIMEOUT_S)
            if w.process.is_alive():
                w.process.kill()
                w.process.join()
