"""What `prefill-server` and `decode-server` share on the command line: engine flags + server flags,
then serve until SIGTERM. Each role's launcher (prefill/cli.py, decode/cli.py) names its gRPC
service and its scheduler process; nothing here knows a role.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import secrets
import sys
from dataclasses import dataclass
from typing import Callable

from pdserve.common.config import DefaultsHelpFormatter, EngineConfig, add_cli_args, from_cli_args
from pdserve.common.errors import StartupFailed
from pdserve.common.server_config import ServerConfig
from pdserve.common.stacks import dump_on_signal
from pdserve.common.trust import check_exposure, load_trust


@dataclass(frozen=True)
class RoleLauncher:
    """How a role is served: its name, its gRPC servicer and service, its scheduler process."""

    role: str  # "prefill" | "decode": the CLI's name, the agent name's prefix, the metrics label
    servicer: type  # a CommonRpcs subclass implementing the role's service
    add_servicer: Callable  # pb_grpc.add_<Service>Servicer_to_server
    service_name: str  # the fully qualified service name, for the health service
    run_scheduler: Callable  # the scheduler process's entry point (engine config, server config, agent name, ipc paths)


def build_parser(role: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"{role}-server",
        description=f"pdserve {role} server: a gRPC frontend process and a scheduler process that owns the model.",
        formatter_class=DefaultsHelpFormatter,
    )
    add_cli_args(parser, EngineConfig)
    add_cli_args(parser, ServerConfig)
    return parser


def main(launcher: RoleLauncher, argv: list[str] | None = None) -> int:
    role = launcher.role
    args = build_parser(role).parse_args(argv)
    server = from_cli_args(args, ServerConfig)
    logging.basicConfig(level=server.log_level.upper(), format=f"%(asctime)s %(levelname)s {role}: %(message)s")
    dump_on_signal()  # `kill -USR1 <pid>`: every thread's stack to the log (common/stacks.py)
    try:
        server.check()
        check_exposure(load_trust(server), [server.host], "listening on")  # refused here, warned of when serving
        engine = from_cli_args(args, EngineConfig).resolve()
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    agent_name = server.agent_name or f"{role}-{server.host}-{server.port}-{secrets.token_hex(3)}"
    if engine.device == "cpu":
        # NOTE: OpenMP threads that spin-wait between torch ops steal the cores of the other
        # servers on the host (a prefill and a decode server on 2 cores, 8 streams: TTFT p50
        # 6.6 -> 5.0 s, output +8% with PASSIVE; docs/benchmarks/README.md). Read once, when the scheduler
        # process loads torch, so it is set here, before that process is spawned.
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    try:
        asyncio.run(_serve(launcher, engine, server, agent_name))
    except StartupFailed as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 1
    return 0


async def _serve(launcher: RoleLauncher, engine: EngineConfig, server: ServerConfig, agent_name: str) -> None:
    from pdserve.common.serving.frontend import SchedulerBridge, serve
    from pdserve.common.serving.server_metrics import Metrics
    from pdserve.common.tracing import start_tracing

    args = (engine, server, agent_name)
    tracer = start_tracing(f"pdserve-{launcher.role}", server.otlp_traces_endpoint)
    bridge = SchedulerBridge(launcher.run_scheduler, args, Metrics(launcher.role), tracer)
    await serve(launcher.servicer, launcher.add_servicer, bridge, server, launcher.service_name)
