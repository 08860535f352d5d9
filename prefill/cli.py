"""`prefill-server`: see `prefill-server --help`."""

import sys

from pdserve.common.serving.server_cli import main as serve_role


def main(argv: list[str] | None = None) -> int:
    from pdserve.prefill.server import LAUNCHER  # grpc and the servicer load after argument parsing errors, not before

    return serve_role(LAUNCHER, argv)


if __name__ == "__main__":
    sys.exit(main())
