"""`pdserve` command line: one sub-command per job.

    pdserve make-tiny-model DIR --arch llama [--seed N]
    pdserve run-batch -i IN.jsonl -o OUT.jsonl --model-path DIR [engine flags]
    pdserve up [--model-path DIR] [--num-prefill N] [--num-decode M] [--device ...] [--port ...] [--prefill-policy P]
    pdserve bench offline|serve ...  (see `pdserve bench offline --help`, bench/cli.py)

Heavy imports (torch, transformers) happen inside the sub-commands, so `--help` is instant.
`make-tiny-model` and `run-batch` are the engine's own; the others come from the packages that own
them (router/up.py, bench/cli.py), registered as entry points of the group `pdserve.commands`
(pyproject.toml), so this module never imports a role.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from importlib.metadata import entry_points

from pdserve.common.config import EngineConfig, add_cli_args, from_cli_args, show_defaults
from pdserve.common.openai.defaults import DefaultsFlags

COMMANDS = "pdserve.commands"  # entry-point group: callables that add sub-commands to `pdserve`


def _make_tiny_model(args: argparse.Namespace) -> int:
    from pdserve.common.tiny_model import make_tiny_model

    path = make_tiny_model(args.dir, args.arch, args.seed)
    print(f"wrote a tiny {args.arch} checkpoint to {path}")
    return 0


def _run_batch(args: argparse.Namespace) -> int:
    from pdserve.common.engine.engine import Engine
    from pdserve.common.openai.run_batch import run_batch

    if not os.path.isfile(args.input):
        print(f"error: input file {args.input!r} does not exist", file=sys.stderr)
        return 2
    config = from_cli_args(args, EngineConfig)
    try:
        defaults = from_cli_args(args, DefaultsFlags).sampling_defaults(config.model_path)
        engine = Engine(config)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    counts = run_batch(engine, args.input, args.output, engine.config.served_model_name, defaults)
    print(
        f"{counts['total']} requests: {counts['succeeded']} succeeded, {counts['failed']} failed; "
        f"results in {args.output}"
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    from pdserve.common.tiny_model import ARCHS

    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--log-level", default="warning", help="Python logging level (debug, info, warning).")
    sub = parser.add_subparsers(dest="command", required=True)

    tiny = sub.add_parser("make-tiny-model", help="Write a small deterministic random-weight HF checkpoint.")
    tiny.add_argument("dir", help="Output directory (created if missing).")
    tiny.add_argument("--arch", required=True, choices=ARCHS, help="Model architecture.")
    tiny.add_argument("--seed", type=int, default=0, help="Weight seed; same seed, same bytes.")
    tiny.set_defaults(func=_make_tiny_model)

    batch = sub.add_parser(
        "run-batch",
        help="Run an OpenAI Batch file (/v1/completions, /v1/chat/completions) through the engine.",
    )
    batch.add_argument("-i", "--input", required=True, help="Input JSONL: {custom_id, method, url, body} per line.")
    batch.add_argument("-o", "--output", required=True, help="Output JSONL: one result line per input line.")
    add_cli_args(batch, EngineConfig)
    add_cli_args(batch, DefaultsFlags)
    batch.set_defaults(func=_run_batch)

    for command in sorted(entry_points(group=COMMANDS), key=lambda ep: ep.name):
        command.load()(sub)  # adds its sub-parser(s), each with set_defaults(func=...)
    return show_defaults(parser)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.argv = argv  # the benchmarks record their command line
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
