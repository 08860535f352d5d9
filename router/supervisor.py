"""`pdserve-router --workers N` (N > 1): N worker processes serve one port; this process keeps them.

- The port is bound once here and let go before any worker starts: a port in use is an immediate
  error, not N workers failing one after another.
- Each worker (router/serve.py) binds --host/--port with SO_REUSEPORT and runs its own Router: its
  own gRPC channels, health checks, circuit breakers and policies (router/policies.py says how
  each policy behaves across processes).
- /metrics, in any worker, reports all of them: prometheus_client's multiprocess mode, in a fresh
  directory made here and removed at exit (router/metrics.py).
- One more process is kept, started with the workers: the warm spare (router/serve.py's
  run_spare; --no-warm-spare: none). It has imported the web stack and built its Router (the
  tokenizer: seconds, far more on a loaded host) but not bound the port — bound, the kernel would
  give it connections — and says "warm". A worker that dies is replaced by the spare at once: sent
  the slot's index, it binds and serves, and another spare is started. Without a warm spare (it is
  still warming, or gone) the slot gets a worker started afresh, as it would without spares.
- The router has started once every worker serves and the spare is warm (or there will be none):
  this process then writes STARTED_FILE in the metrics directory, and only from then on does a
  worker's /readiness say ready. Building a worker loads the tokenizer (one core for seconds, ~15 s
  on a loaded 16-core GPU host): a burst sent while some still build would run beside that, and
  the kernel would have given all its connections to the workers already listening.
- A worker that dies before it serves is a failed start: at the first start that ends the router
  (everything runs the same flags, so the next try fails alike: a bad --model-path, say); later,
  MAX_FAILED_STARTS in a row of one worker do. A spare that dies is started again; one that dies
  before it is warm is a failed start, and MAX_FAILED_STARTS of them in a row end the spares (not
  the router: its workers still serve), dead workers then being started afresh.
- SIGTERM and SIGINT are passed on to the workers as SIGTERM (uvicorn drains their connections),
  and this process exits 0 when they are gone; a SIGINT after that is passed on as SIGINT,
  uvicorn's "stop now". The spare gets SIGTERM too (it has nothing to drain) and is never promoted
  once a stop is asked.

NOTE: workers are never forked from this process or a worker: a forked child would inherit the
parent's threads' locks (grpc's, the tokenizer's) in whatever state they were. They are forked by
multiprocessing's fork server, a fresh process that has only imported router/preload.py (the web
stack and transformers, torch kept out) and does nothing else: one import at start instead of one
per worker. So the workers are this process's grandchildren (the fork server's children), and a
worker that sees its parent change takes the supervisor for gone (the fork server ends with it; a
fork server killed alone stops the workers too, and the supervisor starts them again, through a new
one).

A GGUF checkpoint's tokenizer is converted into the cache before the workers start (by a child
process: the conversion needs torch), so that they load it rather than each convert it
(common/gguf_tokenizer.py).
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

from pdserve.common.gguf_checkpoint import gguf_file
from pdserve.common.gguf_tokenizer import convert_once
from pdserve.router.config import RouterConfig
from pdserve.router.serve import STARTED_FILE, bind, run_spare, run_worker

log = logging.getLogger(__name__)

MAX_FAILED_STARTS = 5  # in a row, of one worker (or of the spare), once the router has served
STOP_TIMEOUT_S = 10.0  # after a failed start: how long the other workers get before SIGKILL


@dataclass
class Worker:
    """One worker slot: its current process and the pipe it says "ready" on."""

    index: int
    process: BaseProcess
    ready: Connection  # read end (a promoted spare's: its two-way pipe)
    serving: bool = False  # said ready
    exited: bool = False  # death seen and handled
    failed_starts: int = 0  # consecutive deaths before serving, of this slot


@dataclass
class Spare:
    """The warm spare: a process built as a worker is, waiting for a slot's index on its pipe."""

    process: BaseProcess
    pipe: Connection  # two-way: it says "warm" (and, once promoted, "ready"); we send the index
    warm: bool = False  # said warm


def describe_exit(code: int) -> str:
    return f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"


class Supervisor:
    def __init__(self, config: RouterConfig, target=run_worker, spare_target=run_spare):
        """`target(config, index, ready_connection, metrics_dir)` is what a worker process runs, and
        `spare_target(config, connection, metrics_dir)` what the spare runs (tests swap them)."""
        self.config = config
        self.target = target
        self.spare_target = spare_target
        self.context = multiprocessing.get_context("forkserver")
        self.context.set_forkserver_preload(["pdserve.router.preload"])
        self.workers: list[Worker] = []
        self.spare: Spare | None = None
        self.spare_failed_starts = 0  # in a row; at MAX_FAILED_STARTS no more spares
        self.received: list[int] = []  # SIGTERM/SIGINT not yet passed on
        self.stopping = False
        self.all_served = False  # every slot has served once
        self.started = False  # ... and the spare was warm (or will not be): STARTED_FILE written
        self.metrics_dir = ""

    def run(self) -> int:
        """Start the workers, keep them, stop them; the exit code."""
        try:
            bind(self.config.host, self.config.port, reuse_port=False).close()
        except OSError as e:
            print(f"error: cannot listen on {self.config.host}:{self.config.port}: {e.strerror or e}", file=sys.stderr)
            return 2
        gguf = gguf_file(self.config.model_path)
        if gguf is not None:
            convert_once(gguf)
        self.metrics_dir = tempfile.mkdtemp(prefix="pdserve-router-metrics-")
        wake_read, wake_write = socket.socketpair()
        wake_write.setblocking(False)
        previous_wakeup = signal.set_wakeup_fd(wake_write.fileno())  # a signal ends wait() at once
        previous_handlers = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            self.workers = [self._start(i) for i in range(self.config.workers)]
            self._keep_a_spare()
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
        process = self.context.Process(
            target=self.target,
            args=(self.config, index, ready_in_child, self.metrics_dir),
            name=f"pdserve-router-worker-{index}",
            daemon=True,
        )
        process.start()
        ready_in_child.close()  # the child holds its own copy: our read end sees EOF when it dies
        return Worker(index, process, ready, failed_starts=failed_starts)

    def _start_spare(self) -> Spare:
        pipe, pipe_in_child = self.context.Pipe(duplex=True)
        process = self.context.Process(
            target=self.spare_target,
            args=(self.config, pipe_in_child, self.metrics_dir),
            name="pdserve-router-spare",
            daemon=True,
        )
        process.start()
        pipe_in_child.close()  # as in _start: EOF when it dies
        return Spare(process, pipe)

    def _watch(self, wake: socket.socket) -> int:
        while True:
            alive = [w for w in self.workers if not w.exited]
            spare = self.spare
            if self.stopping and not alive and spare is None:
                return 0
            waiting = [wake] + [w.process.sentinel for w in alive] + [w.ready for w in alive if not w.serving]
            if spare is not None:
                waiting += [spare.process.sentinel] + ([] if spare.warm else [spare.pipe])
            woken = wait(waiting)
            if wake in woken:
                wake.recv(4096)
            self._forward_stop_signals()  # before the exits: a Ctrl-C reaches the workers too
            for w in alive:
                if not w.serving and w.ready in woken:
                    self._note_ready(w)
            if spare is not None and spare.pipe in woken:
                self._note_warm(spare)
            if spare is not None and spare.process.sentinel in woken:
                self._on_spare_exit(spare)  # before the workers': a dead spare is never promoted
            for w in alive:
                if w.process.sentinel in woken:
                    code = self._on_exit(w)
                    if code is not None:
                        return code
            self._keep_a_spare()
            self._note_started()

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
            pids = [w.process.pid for w in self.workers if not w.exited]
            if self.spare is not None:
                pids.append(self.spare.process.pid)  # (it ignores SIGINT: SIGTERM has ended it)
            for pid in pids:
                try:
                    os.kill(pid, sig)
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

    def _note_started(self) -> None:
        spare_done = self.config.no_warm_spare or self.spare_failed_starts >= MAX_FAILED_STARTS
        if self.started or not self.all_served or not (spare_done or (self.spare is not None and self.spare.warm)):
            return
        self.started = True
        with open(os.path.join(self.metrics_dir, STARTED_FILE), "w"):
            pass  # the workers' /readiness looks for it

    def _note_warm(self, spare: Spare) -> None:
        try:
            spare.pipe.recv()
        except EOFError:
            return  # it died while warming: its sentinel says so
        spare.warm, self.spare_failed_starts = True, 0
        log.info("spare (pid %d) warm", spare.process.pid)

    def _on_exit(self, w: Worker) -> int | None:
        """Handle the death of w's process: replace it, or say why not (the exit code)."""
        self._reap(w.process, w.ready)
        w.exited = True
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
        replacement = self._promote(w.index, w.failed_starts)
        if replacement is not None:
            log.warning("%s; the warm spare (pid %d) takes its place", how, replacement.process.pid)
        else:
            log.warning("%s; starting it again", how)
            replacement = self._start(w.index, w.failed_starts)
        self.workers[w.index] = replacement
        return None

    def _promote(self, index: int, failed_starts: int) -> Worker | None:
        """The warm spare, told to serve as slot `index`; None when there is none to tell."""
        spare = self.spare
        if spare is None or not spare.warm:
            return None
        try:
            spare.pipe.send(index)
        except OSError:
            return None  # it died just now: its sentinel says so next
        self.spare = None
        return Worker(index, spare.process, spare.pipe, failed_starts=failed_starts)

    def _on_spare_exit(self, spare: Spare) -> None:
        """A spare that dies is started again (by _keep_a_spare), unless it keeps failing to warm."""
        self._reap(spare.process, spare.pipe)
        self.spare = None
        if self.stopping or self.received:
            return
        how = f"spare (pid {spare.process.pid}) {describe_exit(spare.process.exitcode)}"
        if spare.warm:
            log.warning("%s; starting another", how)
            return
        self.spare_failed_starts += 1
        if self.spare_failed_starts >= MAX_FAILED_STARTS:
            log.error(
                "%s while warming, its %dth time in a row; no spare from now on (a dead worker is started afresh)",
                how,
                self.spare_failed_starts,
            )
        else:
            log.warning("%s while warming; starting another", how)

    def _keep_a_spare(self) -> None:
        """Start a spare when there is none and nothing stops us (the first with the workers)."""
        if (
            self.spare is None
            and not self.config.no_warm_spare
            and not self.stopping
            and not self.received
            and self.spare_failed_starts < MAX_FAILED_STARTS
        ):
            self.spare = self._start_spare()

    def _reap(self, process: BaseProcess, pipe: Connection) -> None:
        from prometheus_client.multiprocess import mark_process_dead

        process.join()
        pipe.close()
        mark_process_dead(process.pid, self.metrics_dir)  # its live gauges (in flight, health) leave /metrics

    def _stop_all(self) -> None:
        """SIGTERM what is still running, SIGKILL what outlives STOP_TIMEOUT_S (after a failure only:
        a stop asked by a signal has already waited for every worker)."""
        processes = [w.process for w in self.workers] + ([self.spare.process] if self.spare is not None else [])
        for process in processes:
            if process.is_alive():
                process.terminate()
        for process in processes:
            process.join(STOP_TIMEOUT_S)
            if process.is_alive():
                process.kill()
                process.join()
