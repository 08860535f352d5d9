"""One router process: bind the HTTP port, build the Router, run uvicorn on that socket.

`pdserve-router --workers 1` runs this in its own process. With more, each worker process of the
supervisor (router/supervisor.py) runs it, every one binding --host/--port with SO_REUSEPORT: the
kernel spreads new connections over the listening sockets (by address hash), and a connection stays
with the process that accepted it — so a worker that dies takes only its own connections along.

uvicorn serves with its own HTTP protocol and the guards of router/http_protocol.py (header- and
body-read timeouts, a cap on connections). On SIGTERM it closes the idle connections and waits at
most --drain-timeout for the requests in flight. Its access log (a line per HTTP request) is on only
at --log-level debug: at info the router logs a line per OpenAI request itself (router/openai_routes.py).

The port is bound before the Router is built (tokenizer, chat template), so a port in use fails
at once. The supervisor's warm spare (`run_spare`) builds first and binds only once it is promoted
into a dead worker's slot: a socket bound with SO_REUSEPORT gets its share of the connections, and
a spare must get none.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from pdserve.common.config import check_model_path
from pdserve.common.gc_tuning import tune_gc
from pdserve.router.config import RouterConfig
from pdserve.router.metrics_env import MULTIPROC_DIR_ENV

if TYPE_CHECKING:
    import uvicorn

log = logging.getLogger(__name__)

# uvicorn calls its process-manager hook (callback_notify) from its once-a-second tick when at
# least this long has passed since the last call: so once a second, and at once when it starts.
HEARTBEAT_S = 0.5
STARTED_FILE = "started"  # in the metrics directory: the supervisor's word that every worker serves

# What `ps`, `top` and the tests see of a supervised process (/proc/PID/comm, 15 bytes at most).
WORKER_NAME = "pdserve-worker"  # a worker slot's process, starting or serving
WARMING_NAME = "pdserve-warming"  # the spare, building
SPARE_NAME = "pdserve-spare"  # the spare, built: waits to be promoted


def configure_logging(level: str, who: str) -> None:
    # force: a promoted spare names itself anew ("router spare" -> "router worker N")
    logging.basicConfig(level=level.upper(), format=f"%(asctime)s %(levelname)s {who}: %(message)s", force=True)


def name_process(name: str) -> None:
    """Show `name` as this process's command name (Linux; nothing elsewhere)."""
    try:
        with open("/proc/self/comm", "w") as f:
            f.write(name)
    except OSError:
        pass


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


def bind_or_say_why(config: RouterConfig, reuse_port: bool) -> socket.socket | None:
    try:
        return bind(config.host, config.port, reuse_port)
    except OSError as e:
        print(f"error: cannot listen on {config.host}:{config.port}: {e.strerror or e}", file=sys.stderr)
        return None


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


def build(config: RouterConfig, supervisor: Connection | None) -> uvicorn.Server | None:
    """The uvicorn server of a Router, ready to run on a socket; None (the error printed) when the
    model path or tokenizer is unusable.

    `supervisor`: the pipe a supervised worker says "ready" on once it serves; such a worker also
    writes its metrics gauges every second and stops when the supervisor is gone.

    NOTE: a spare runs this long before it may serve: nothing here may talk to a server or show in
    /metrics as serving. Router() loads the tokenizer and writes zeros (its counters, histograms and
    in-flight gauge: nothing added to the sums); its channels and health checks start with the app's
    lifespan, when uvicorn runs, and pdserve_router_worker_healthy (a `pid` series per serving
    process) with the first heartbeat."""
    try:
        check_model_path(config.model_path)  # a directory with config.json, or a GGUF file
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return None
    import uvicorn

    from pdserve.router.app import Router, create_app
    from pdserve.router.http_protocol import Guards, guarded_protocol, raise_open_file_limit

    raise_open_file_limit()  # before the cap is sized from it
    try:
        router = Router(config)
        if supervisor is not None:
            router.started_file = os.path.join(os.environ[MULTIPROC_DIR_ENV], STARTED_FILE)
        guards = Guards.from_config(config, count=lambda reason: router.metrics.connections_closed.labels(reason).inc())
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return None
    parent = os.getppid()
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
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(router),
            loop=loop,
            http=guarded_protocol(http, guards),
            log_level=config.log_level.lower(),
            access_log=config.log_level.lower() == "debug",
            timeout_graceful_shutdown=config.drain_timeout,
            callback_notify=None if supervisor is None else heartbeat,
            timeout_notify=HEARTBEAT_S,
        )
    )
    server.config.load()  # uvicorn's protocol and lifespan imports: now, not when the socket listens
    tune_gc()  # the tokenizer and the web stack are the start-up heap
    return server


def run_server(server: uvicorn.Server, sock: socket.socket) -> int:
    """Serve on `sock` until SIGTERM/SIGINT (uvicorn drains the open connections); the exit code."""
    server.run(sockets=[sock])
    return 0 if server.started else 3  # 3: the start-up failed (uvicorn's own code for it)


def serve(config: RouterConfig, supervisor: Connection | None = None) -> int:
    """Bind, build, serve (`build` says what `supervisor` is for); the exit code."""
    sock = bind_or_say_why(config, reuse_port=supervisor is not None)
    if sock is None:
        return 2
    server = build(config, supervisor)
    if server is None:
        return 2
    return run_server(server, sock)


def supervised(config: RouterConfig, metrics_dir: str, name: str, who: str) -> None:
    """What every supervised process does first (a worker's or the spare's entry)."""
    os.environ[MULTIPROC_DIR_ENV] = metrics_dir
    # Ctrl-C at a terminal reaches the whole process group; the supervisor passes it on as SIGTERM.
    # Ignored here until uvicorn takes over the handler (a worker still starting has nothing to drain).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    name_process(name)
    configure_logging(config.log_level, who)


def run_worker(config: RouterConfig, index: int, supervisor: Connection, metrics_dir: str) -> None:
    """A supervised worker process's entry (forked by the supervisor's fork server); its metrics go to
    `metrics_dir`."""
    supervised(config, metrics_dir, WORKER_NAME, f"router worker {index}")
    sys.exit(serve(config, supervisor))


def run_spare(config: RouterConfig, supervisor: Connection, metrics_dir: str) -> None:
    """The warm spare's entry: build what a worker builds, say "warm", wait; once the supervisor
    sends a slot index, bind and serve as that slot's worker (saying "ready" on the same pipe).
    A SIGTERM before then ends it at once (the default action: it holds nothing to drain)."""
    supervised(config, metrics_dir, WARMING_NAME, "router spare")
    server = build(config, supervisor)
    if server is None:
        sys.exit(2)
    name_process(SPARE_NAME)
    index = wait_for_promotion(supervisor)
    if index is None:
        log.warning("the supervisor is gone; stopping")
        sys.exit(0)
    name_process(WORKER_NAME)
    configure_logging(config.log_level, f"router worker {index}")
    sock = bind_or_say_why(config, reuse_port=True)
    sys.exit(2 if sock is None else run_server(server, sock))


def wait_for_promotion(supervisor: Connection) -> int | None:
    """Say "warm"; the slot index the supervisor sends then; None once the supervisor is gone.

    NOTE: the pipe shows EOF when the supervisor dies; the parent check is the heartbeat's, for a
    supervisor that is gone while something else still holds its end."""
    parent = os.getppid()
    try:
        supervisor.send("warm")
    except OSError:
        return None
    while os.getppid() == parent:
        try:
            if supervisor.poll(HEARTBEAT_S):
                return supervisor.recv()
        except (EOFError, OSError):
            return None
    return None
