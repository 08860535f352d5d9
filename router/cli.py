"""`pdserve-router`: the OpenAI-compatible HTTP front door (see `pdserve-router --help`)."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from pdserve.common.config import add_cli_args, from_cli_args
from pdserve.router.config import RouterConfig
from pdserve.router.serve import MULTIPROC_DIR_ENV, configure_logging, serve
from pdserve.router.supervisor import Supervisor


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
    config = config.resolve()
    if config.workers == 1:  # one process, no supervisor: the metrics stay in its own registry
        os.environ.pop(MULTIPROC_DIR_ENV, None)
        configure_logging(config.log_level, "router")
        return serve(config)
    configure_logging(config.log_level, "router supervisor")
    logging.getLogger(__name__).info("%d workers, prefill policy %s", config.workers, config.prefill_policy)
    return Supervisor(config).run()


if __name__ == "__main__":
    sys.exit(main())
