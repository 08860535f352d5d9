"""One router process: bind the HTTP port, build the Router, run uvicorn on that socket.

`pdserve-router --workers 1` runs this in its own process. With more, each worker process of the
supervisor (router/supervisor.py) runs it, every one binding --host/--port with SO_REUSEPORT: the
kernel spreads new connections over the listening sockets (by address hash), and a connection stays
with the process that accepted it — so a worker that dies takes only its own connections along.

The port is bound before the Router is built (tokenizer, chat template), so a port in use fails
at once.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
from multiprocessing.connection import Connection

from pdserve.common.gc_tuning import tune_gc
from pdserve.router.config import RouterConfig

log = logging.getLogger(__name__)

# NOTE: prometheus_client reads this variable once, when it is first imported, to decide where its
# values live (a file per process in that directory, or its own memory): a worker sets it before
# anything imports prometheus_client, and --workers 1 clears it. RouterMetrics reads it to render.
MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"

# uvicorn calls its process-manager hook (callback_notify) from its once-a-second tick when at
# least this long has passed since the last call: so once a second, and at once when it starts.
HEARTBEAT_S = 0.5


def configure_logging(level: str, who: str) -> None:
    logging.basicConfig(level=level.upper(), format=f"%(asctime)s %(levelname)s {who}: %(message)s")


def bind(host: str, port: int, reuse_port: bool) -> socket.socket:
    """A TCP socket bound (not yet listening) to host:port; OSError when the port is taken.

    NOTE: without reuse_port, binding fails while any socket holds the port, SO_REUSEPORT or not —
    the supervisor's check that no other router (or anything else) serves it already."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET  # as uvicorn decides
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart need not wait out TIME_WAIT
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def event_loop_and_http() -> tuple[str, str]:
    """uvloop and httptools when they import (the faster pair), else asyncio and h11."""
    try:
        import uvloop  # noqa: F401
        loop = "uvloop"
    except ImportError:
        loop = "asyncio"
    try:
        import httptools  # noqa: F401
        http = "httptools"
    except ImportError:
        http = "h11"
    return loop, http


def serve(config: RouterConfig, supervisor: Connection | None = None) -> int:
    """Serve until SIGTERM/SIGINT (uvicorn drains the open connections); the exit code.

    `supervisor`: the pipe a supervised worker says "ready" on once it serves; such a worker also
    writes its metrics gauges every second and stops when the supervisor is gone."""
    parent = os.getppid()
    try:
        sock = bind(config.host, config.port, reuse_port=supervisor is not None)
    except OSError as e:
        print(f"error: cannot listen on {config.host}:{config.port}: {e.strerror or e}", file=sys.stderr)
        return 2
    if not os.path.isfile(os.path.join(config.model_path, "config.json")):
        print(f"error: --model-path {config.model_path!r} has no config.json", file=sys.stderr)
        return 2
    import uvicorn

    from pdserve.router.app import Router, create_app

    try:
        router = Router(config)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    announced = False

    async def heartbeat() -> None:
        nonlocal announced
        router.metrics.update(router.inflight)  # a scrape may land on another worker
        if not announced:
            announced = True
            try:
                supervisor.send("ready")
            except OSError:
                pass  # the supervisor is gone: see below
        if os.getppid() != parent:  # the supervisor was killed: nobody would stop or replace us
            log.warning("the supervisor (pid %d) is gone; stopping", parent)
            server.should_exit = True

    loop, http = event_loop_and_http()
    app = create_app(router)
    tune_gc()  # the tokenizer and the web stack are the start-up heap
    server = uvicorn.Server(uvicorn.Config(
        app, loop=loop, http=http, log_level=config.log_level.lower(),
        callback_notify=None if supervisor is None else heartbeat, timeout_notify=HEARTBEAT_S))
    server.run(sockets=[sock])
    return 0 if server.started else 3  # 3: the start-up failed (uvicorn's own code for it)


def run_worker(config: RouterConfig, index: int, supervisor: Connection, metrics_dir: str) -> None:
    """A supervised worker process's entry (multiprocessing spawn); its metrics go to `metrics_dir`."""
    os.environ[MULTIPROC_DIR_ENV] = metrics_dir
    # Ctrl-C at a terminal reaches the whole process group; the supervisor passes it on as SIGTERM.
    # Ignored here until uvicorn takes over the handler (a worker still starting has nothing to drain).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    configure_logging(config.log_level, f"router worker {index}")
    sys.exit(serve(config, supervisor))
