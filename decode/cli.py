"""`decode-server`: see `decode-server --help`."""

import sys

from pdserve.common.server_cli import main as _main


def main() -> int:
    return _main("decode")


if __name__ == "__main__":
    sys.exit(main())
