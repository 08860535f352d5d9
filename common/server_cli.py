"""The command line shared by `prefill-server` and `decode-server`: engine flags + server flags."""

from __future__ import annotations

import argparse
import asyncio
import logging
import secrets
import sys

from pdserve.common.config import EngineConfig, ServerConfig, add_cli_args, from_cli_args


def main(role: str, argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=f"{role}-server",
        description=f"pdserve {role} server: a gRPC frontend process and a scheduler process that owns the model.",
    )
    add_cli_args(parser, EngineConfig)
    add_cli_args(parser, ServerConfig)
    args = parser.parse_args(argv)
    server = from_cli_args(args, ServerConfig)
    logging.basicConfig(level=server.log_level.upper(), format=f"%(asctime)s %(levelname)s {role}: %(message)s")
    try:
        server.check()
        engine = from_cli_args(args, EngineConfig).resolve()
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    agent_name = server.agent_name or f"{role}-{server.host}-{server.port}-{secrets.token_hex(3)}"
    asyncio.run(_serve(role, engine, server, agent_name))
    return 0


async def _serve(role: str, engine: EngineConfig, server: ServerConfig, agent_name: str) -> None:
    from pdserve.common.serving import Metrics, SchedulerBridge, serve
    from pdserve.proto import pdserve_pb2_grpc as pb_grpc

    if role == "decode":
        from pdserve.decode.server import DecodeServicer as servicer, run_decode_scheduler as target

        add, service = pb_grpc.add_DecodeServiceServicer_to_server, "pdserve.v1.DecodeService"
    else:
        from pdserve.prefill.server import PrefillServicer as servicer, run_prefill_scheduler as target

        add, service = pb_grpc.add_PrefillServiceServicer_to_server, "pdserve.v1.PrefillService"
    bridge = SchedulerBridge(target, (engine, agent_name, server.kv_transfer_timeout, server.log_level), Metrics(role))
    await serve(servicer, add, bridge, server.host, server.port, server.metrics_port, service)
