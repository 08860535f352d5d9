"""`pdserve-router`: the OpenAI-compatible HTTP front door (see `pdserve-router --help`)."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from pdserve.common.config import DefaultsHelpFormatter, add_cli_args, from_cli_args
from pdserve.common.torch_free import keep_torch_out
from pdserve.router.config import RouterConfig
from pdserve.router.serve import MULTIPROC_DIR_ENV, configure_logging, serve
from pdserve.router.supervisor import Supervisor


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pdserve-router",
        description="OpenAI-compatible router pairing prefill and decode servers.",
        formatter_class=DefaultsHelpFormatter,
    )
    add_cli_args(p, RouterConfig)
    return p


def main(argv: list[str] | None = None) -> int:
    config = from_cli_args(build_parser().parse_args(argv), RouterConfig)
    try:
        config.check()
        unauthenticated = _check_trust(config)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    config = config.resolve()
    keep_torch_out()  # this process and the workers it starts only tokenize (common/torch_free.py)
    single = config.workers == 1
    configure_logging(config.log_level, "router" if single else "router supervisor")
    if unauthenticated:
        logging.getLogger(__name__).warning("%s", unauthenticated)
    if single:  # one process, no supervisor: the metrics stay in its own registry
        os.environ.pop(MULTIPROC_DIR_ENV, None)
        return serve(config)
    logging.getLogger(__name__).info("%d workers, prefill policy %s", config.workers, config.prefill_policy)
    return Supervisor(config).run()


def _check_trust(config: RouterConfig) -> str | None:
    """ValueError when the router would reach servers off this host without a secret or TLS (and
    --allow-unauthenticated is not given); the warning to log when it is."""
    from pdserve.common.trust import check_exposure, host_of, load_trust

    servers = [*config.prefill, *config.decode, *config.prefill_dns, *config.decode_dns]
    return check_exposure(load_trust(config), map(host_of, servers), "reaching servers at")


if __name__ == "__main__":
    sys.exit(main())
