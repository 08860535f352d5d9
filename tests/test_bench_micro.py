"""bench/ and bench/micro/: `pdserve bench --help` lists the benchmarks of a deployment, names the
micro-benchmarks after them (which still run under their old sub-command names), and the two
folders' split holds (bench/micro/__init__.py lists every micro module; bench/ never needs one)."""

import re
from pathlib import Path

from pdserve.bench.micro.cli import MODULES
from pdserve.common.cli import build_parser

BENCH = Path(__file__).resolve().parents[1] / "bench"
MICRO_COMMANDS = ("spec-replay", "spec-itl", "spec-overlap", "transfer")


def _bench_help() -> str:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return sub.choices["bench"].format_help()


def test_help_lists_the_deployment_benchmarks_and_names_the_micro_ones_after():
    text = _bench_help()
    listed, epilog = text.split("micro-benchmarks (developer tools, bench/micro/)")
    for command in ("offline", "serve", "accuracy"):
        assert re.search(rf"^    {command} ", listed, re.M), command
    for command in MICRO_COMMANDS:
        assert command not in listed.split("positional arguments:")[1]
        assert re.search(rf"^  {command} +\S", epilog, re.M), command
    for name in MODULES.split():
        assert name in epilog
    assert "pdserve.bench.soak|migration|startup" in listed


def test_the_micro_sub_commands_still_run_under_their_names():
    parser = build_parser()
    assert parser.parse_args(["bench", "transfer", "--requests", "2"]).func.__module__ == "pdserve.bench.micro.cli"
    for command in ("spec-replay", "spec-itl", "spec-overlap"):
        args = parser.parse_args(["bench", command, "--model-path", "x"])
        assert args.func.__module__ == f"pdserve.bench.micro.{command.replace('-', '_')}"


def test_every_micro_module_is_listed_and_every_runnable_one_named_in_the_help():
    listing = (BENCH / "micro" / "__init__.py").read_text()
    runnable = set()
    for path in sorted((BENCH / "micro").glob("*.py")):
        if path.stem in ("__init__", "cli"):
            continue
        assert path.stem in listing, f"{path.name} is missing from bench/micro/__init__.py"
        if 'if __name__ == "__main__"' in path.read_text():
            runnable.add(path.stem)
    assert runnable == set(MODULES.split())


def test_the_deployment_benchmarks_need_no_micro_module():
    for path in BENCH.glob("*.py"):
        if path.name != "cli.py":  # it registers the micro sub-commands (bench/micro/cli.py)
            assert not re.search(r"^\s*(from|import) pdserve\.bench\.micro", path.read_text(), re.M), path.name
