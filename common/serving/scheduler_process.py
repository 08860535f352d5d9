"""The scheduler process of a server: owns the role's engine (model, KV pools, agent) and runs its loop.

    engine = make_engine(startup)               # PrefillEngine or DecodeEngine, timing its phases
    engine.channel = Channel(...)               # the loop's recv_requests / send_outputs use it
    for _ in engine.event_loop():               # event_loop_overlap_disagg_{prefill,decode}
        channel.report_load(engine)             # the frontend's gauges, a few times a second
        if channel.done(engine): break          # drained, or the frontend is gone

It runs in its own process (spawned by the frontend), so its busy loop never shares a GIL with
the gRPC frontend.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import sys
import time
import traceback

import zmq

from pdserve.common import stacks
from pdserve.common.errors import ErrorCode
from pdserve.common.lifetime import die_with_parent
from pdserve.common.server_config import ServerConfig
from pdserve.common.serving import ipc
from pdserve.common.startup import READY, StartupClock
from pdserve.common.torch_free import transformers_without_torch

log = logging.getLogger(__name__)

LOAD_REPORT_S = 0.2  # how often the frontend's gauges are refreshed
IDLE_POLL_MS = 20  # how long recv blocks when nothing is running


class Channel:
    """The scheduler's ends of the two ipc sockets. It answers new requests itself once the
    frontend asked it to drain; the engine sees every other message."""

    def __init__(self, inbox, outbox):
        self.inbox, self.outbox = inbox, outbox
        self.draining = False
        self.parent = os.getppid()
        self.last_report = 0.0

    def recv(self, block: bool) -> list:
        # Block (bounded) only when nothing runs: a busy loop must keep the device fed.
        msgs = []
        if not self.inbox.poll(IDLE_POLL_MS if block else 0):
            return msgs
        while True:
            try:
                msg = ipc.decode_to_scheduler(self.inbox.recv(zmq.NOBLOCK))
            except zmq.Again:
                return msgs
            if isinstance(msg, ipc.Drain):
                self.draining = True
            elif isinstance(msg, ipc.NewRequest) and self.draining:
                self.send(ipc.Rejected(msg.rid, "the server is draining", code=ErrorCode.OVERLOADED))
            else:
                msgs.append(msg)

    def send(self, msg) -> None:
        self.outbox.send(ipc.encode(msg))

    def report_load(self, engine, now: float) -> None:
        if now - self.last_report >= LOAD_REPORT_S:
            self.send(engine.load())
            self.last_report = now

    def done(self, engine) -> bool:
        """Drained (nothing left to run), or the frontend died without a goodbye (SIGKILL, crash):
        nobody can reach this process any more."""
        if os.getppid() != self.parent:
            log.error("frontend process %d is gone; exiting", self.parent)
            return True
        if self.draining and not engine.busy():
            self.send(engine.load())
            return True
        return False


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


def run_scheduler(make_engine, server: ServerConfig, to_scheduler: str, to_frontend: str) -> None:
    """Process entry point: build the role's engine, announce Ready, serve until drained."""
    logging.basicConfig(level=server.log_level.upper(), format="%(asctime)s %(levelname)s scheduler: %(message)s")
    # Ctrl-C at a terminal reaches the whole process group: the frontend drains this process (it
    # sends Drain); SIGTERM (the frontend's, when the drain is over or stuck) exits through the
    # interpreter's teardown, so atexit hooks run (the grammar worker's shared memory is unlinked).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    stacks.dump_on_signal()  # `kill -USR1`: every thread's stack to the log (the frontend's, at a start timeout)
    parent = multiprocessing.parent_process()
    if parent is not None:  # (None: called in-process, by a test)
        die_with_parent(parent.pid)  # even when stuck in native code
        transformers_without_torch()  # the tokenizer without transformers' model stack (common/torch_free.py)
        if not server.disable_grammar_warmup:
            # NOTE here, before this process has a second thread (zmq's below, the engine's): the
            # worker forks with torch imported (common/engine/grammar_prefork.py).
            from pdserve.common.engine import grammar_prefork
            from pdserve.common.engine.grammar_worker import fill_threads, main

            grammar_prefork.prefork(main, fill_threads())
    if server.torch_threads:
        import torch

        # NOTE: two busy scheduler processes on one host, each with a thread per core, slow each
        # other down (measured on 2 cores: docs/benchmarks/README.md): servers sharing a host split it.
        torch.set_num_threads(server.torch_threads)
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.setsockopt(zmq.LINGER, ipc.LINGER_MS)
    inbox.connect(to_scheduler)
    outbox = ctx.socket(zmq.PUSH)
    outbox.setsockopt(zmq.LINGER, ipc.LINGER_MS)
    outbox.connect(to_frontend)
    channel = Channel(inbox, outbox)
    try:
        startup = StartupClock(server.startup_report, server.gpu_after, server.startup_timeout)
        engine = make_engine(startup)
        engine.channel = channel
        startup.mark(READY)
        # NOTE printed, not logged: `pdserve up` runs servers at --log-level warning, and this line
        # is how a user sees where a slow start went (docs/deploy/observe.md, "Start-up").
        # One write, its newline included: the servers `pdserve up` starts share its stderr, and print()
        # writes the text and the newline apart where stderr is unbuffered (PYTHONUNBUFFERED), so another
        # server's line could land between them (bench/startup.py read two engines' phases as one).
        sys.stderr.write(f"{type(engine).__name__} started: {startup.summary()}\n")
        sys.stderr.flush()
        channel.send(engine.ready())
        for _ in engine.event_loop():
            channel.report_load(engine, time.monotonic())
            if channel.done(engine):
                break
        channel.send(ipc.Bye())
    except Exception:  # noqa: BLE001 - report, then let the frontend see the process end
        log.error("scheduler failed:\n%s", traceback.format_exc())
        if parent is None:
            raise
        failed = True
    else:
        failed = False
    finally:
        inbox.close()
        outbox.close()
        ctx.term()
    if failed:
        # NOTE no interpreter teardown after a failure: a TP engine whose rank died leaves an NCCL
        # communicator whose destructor waits for that rank (up to --dist-timeout), and the
        # server would stay up, unable to serve, all that time. The OS frees what this held.
        logging.shutdown()
        os._exit(1)
