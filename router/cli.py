"""`pdserve-router`: the OpenAI-compatible HTTP front door (see `pdserve-router --help`)."""

from __future__ import annotations

import argparse
import logging
import sys

from pdserve.common.config import add_cli_args, from_cli_args
from pdserve.router.config import RouterConfig


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve-router", description="OpenAI-compatible router pairing prefill and decode servers.")
    add_cli_args(p, RouterConfig)
    return p


def main(argv: list[str] | None = None) -> int:
    config = from_cli_args(build_parser().parse_args(argv), RouterConfig)
    try:
        config.check()
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s router: %(message)s")
    import uvicorn

    from pdserve.router.app import Router, create_app

    try:
        router = Router(config)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    uvicorn.run(create_app(router), host=config.host, port=config.port, log_level=config.log_level.lower())
    return 0


if __name__ == "__main__":
    sys.exit(main())
