"""The micro-benchmarks' sub-commands of `pdserve bench` (spec-replay, spec-itl, spec-overlap, transfer):
registered so they run under their names, but left out of `pdserve bench --help`'s list of commands,
which names them in its epilog instead, after the modules run as `python -m pdserve.bench.micro.NAME`
(bench/micro/__init__.py lists both)."""

from __future__ import annotations

import argparse
import textwrap

from pdserve.bench.micro.transfer_cli import add_transfer_parser

MODULES = (
    "allreduce decode_step first_requests fp8_checkpoints fp8_gemm grammar_fill grammar_step host_step host_tier "
    "otlp_sink overlap prefill_latency profile_offline router_memory rpc_auth startup_profile teacher_forced_engine "
    "ttft_breakdown tune_kernels verify_step worker_kill"
)


class _Unlisted:
    """`kinds.add_parser` that keeps each sub-command's one-line help for the epilog and gives argparse
    none: a sub-parser added without help= parses as any other but has no line in the parent's list."""

    def __init__(self, kinds) -> None:
        self.kinds = kinds
        self.helps: dict[str, str] = {}

    def add_parser(self, name: str, help: str = "", **kwargs) -> argparse.ArgumentParser:
        self.helps[name] = help
        return self.kinds.add_parser(name, **kwargs)


def add_micro_parsers(kinds, guarded) -> str:
    """Adds the micro-benchmark sub-commands to `pdserve bench`'s sub-parsers; returns the epilog that
    names them. `guarded` is bench/cli.py's: a bad option prints one line and exits 2."""
    from pdserve.bench.micro import spec_itl, spec_overlap, spec_replay

    def transfer(args: argparse.Namespace) -> int:
        from pdserve.bench.micro.transfer import run_transfer

        return guarded(run_transfer, args, check=None)

    unlisted = _Unlisted(kinds)
    spec_replay.add_parser(unlisted)
    spec_itl.add_parser(unlisted)
    spec_overlap.add_parser(unlisted)
    add_transfer_parser(unlisted).set_defaults(func=transfer)
    lines = [f"  {name:<14}{help}" for name, help in unlisted.helps.items()]
    modules = "\n".join(f"    {line}" for line in textwrap.wrap(MODULES, 88))
    return (
        "micro-benchmarks (developer tools, bench/micro/): pdserve bench COMMAND --help\n"
        + "\n".join(lines)
        + f"\n  and python -m pdserve.bench.micro.NAME --help, NAME one of:\n{modules}"
    )
