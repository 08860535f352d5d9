"""The scheduler process of a server: owns the engine (model, KV pools, agent) and runs its loop.

    while not drained:
        recv_requests()         # non-blocking; blocks (bounded) only when there is nothing to run
        outputs = loop.step()   # one iteration of the role's overlapped (or serial) loop
        send(outputs)           # tokens / results / destinations to the frontend

It runs in its own process (spawned by the frontend), so its busy loop never shares a GIL with
the gRPC frontend. The role-specific parts (what a NewRequest means, what an output becomes)
live in a `Role` (decode/server.py, prefill/server.py).
"""

from __future__ import annotations

import logging
import os
import time
import traceback

import zmq

from pdserve.common import ipc
from pdserve.common.types import SamplingParams

log = logging.getLogger(__name__)

LOAD_REPORT_S = 0.2  # how often the frontend's gauges are refreshed
IDLE_POLL_MS = 20  # how long recv blocks when nothing is running


def sampling_params(p: ipc.Params) -> SamplingParams:
    """Validated SamplingParams (ValueError with a message for the client)."""
    return SamplingParams(**{f: getattr(p, f) for f in p.__struct_fields__})


class Role:
    """What a server role does with messages and loop outputs (see decode/ and prefill/ server.py)."""

    engine = None

    def ready(self) -> ipc.Ready: ...

    def on_request(self, msg: ipc.NewRequest, send) -> None: ...

    def on_destination(self, msg: ipc.SetDestination, send) -> None:
        send(ipc.Rejected(msg.rid, "this server takes no KV destinations", code="INVALID_REQUEST"))

    def on_abort(self, rid: str, send) -> None: ...

    def on_outputs(self, outputs: list, send) -> None: ...

    def load(self) -> ipc.LoadReport: ...


def run_scheduler(make_role, to_scheduler: str, to_frontend: str, log_level: str = "INFO") -> None:
    """Process entry point: build the role's engine, announce Ready, serve until drained."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s scheduler: %(message)s")
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.setsockopt(zmq.LINGER, ipc.LINGER_MS)
    inbox.connect(to_scheduler)
    outbox = ctx.socket(zmq.PUSH)
    outbox.setsockopt(zmq.LINGER, ipc.LINGER_MS)
    outbox.connect(to_frontend)

    def send(msg) -> None:
        outbox.send(ipc.encode(msg))

    try:
        role = make_role()
        send(role.ready())
        _serve(role, inbox, send)
        send(ipc.Bye())
    except Exception:  # noqa: BLE001 - report, then let the frontend see the process end
        log.error("scheduler failed:\n%s", traceback.format_exc())
        raise
    finally:
        inbox.close()
        outbox.close()
        ctx.term()


def _serve(role: Role, inbox, send) -> None:
    loop = role.engine.loop_state()
    draining = False
    last_report = 0.0
    parent = os.getppid()
    while True:
        if os.getppid() != parent:
            # The frontend died without a goodbye (SIGKILL, crash): nobody can reach us any more.
            log.error("frontend process %d is gone; exiting", parent)
            return
        busy = loop.busy()
        # Block only when there is nothing to run: a busy loop must keep the device fed.
        if inbox.poll(0 if busy else IDLE_POLL_MS):
            while True:
                try:
                    data = inbox.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                msg = ipc.decode_to_scheduler(data)
                if isinstance(msg, ipc.NewRequest):
                    if draining:
                        send(ipc.Rejected(msg.rid, "the server is draining", code="OVERLOADED"))
                    else:
                        role.on_request(msg, send)
                elif isinstance(msg, ipc.SetDestination):
                    role.on_destination(msg, send)
                elif isinstance(msg, ipc.Abort):
                    role.on_abort(msg.rid, send)
                elif isinstance(msg, ipc.Drain):
                    draining = True
        if loop.busy():
            role.on_outputs(loop.step(), send)
        now = time.monotonic()
        if now - last_report >= LOAD_REPORT_S:
            send(role.load())
            last_report = now
        if draining and not loop.busy():
            send(role.load())
            return
