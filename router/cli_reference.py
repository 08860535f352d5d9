"""docs/reference/cli.md, written from the parsers that `--help` prints: one table per command.

    python3 -m pdserve.router.cli_reference > docs/reference/cli.md      (make cli-reference)

The parsers are the one source of every flag, default and meaning; tests/test_cli_reference.py fails
when the committed page and the code disagree. (Here, not in common/: it reads the router's and every
role's parsers, and common never imports a role.)
"""

from __future__ import annotations

import argparse
import os
import sys

from pdserve.common.cli import build_parser as pdserve_parser
from pdserve.common.serving.server_cli import build_parser as server_parser
from pdserve.router.cli import build_parser as router_parser

HEADER = """# Command-line reference

Generated from the code by `make cli-reference` (`python3 -m pdserve.router.cli_reference`); do not edit
by hand: tests/test_cli_reference.py fails when this page and `--help` disagree. Each table is one
command's flags as `--help` prints them; a default of "—" means the meaning says what happens without
the flag. Environment variables of the same names in upper case (`KV_TRANSFER_TIMEOUT`, ...) are
documented where a flag says so.
"""


def commands() -> list[tuple[str, argparse.ArgumentParser, str]]:
    """(command line, parser, what it does) of every command and sub-command, in the page's order."""
    found = [(f"{role}-server", server_parser(role), "") for role in ("prefill", "decode")]
    found.append(("pdserve-router", router_parser(), ""))
    found += _with_subcommands("pdserve", pdserve_parser(), "")
    return [(name, parser, parser.description or summary) for name, parser, summary in found]


def _with_subcommands(name: str, parser: argparse.ArgumentParser, summary: str) -> list:
    found = [(name, parser, summary)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            for sub_name, sub in sorted(action.choices.items()):
                found += _with_subcommands(f"{name} {sub_name}", sub, helps.get(sub_name, ""))
    return found


def render() -> str:
    home = os.path.expanduser("~")
    parts = [HEADER]
    for name, parser, summary in commands():
        rows = [_row(parser, action) for action in parser._actions if _documented(action)]
        if not rows:
            continue
        parts.append(f"## `{name}`\n")
        if summary:
            parts.append(_cell(summary) + "\n")
        parts.append("| flag | default | meaning |\n| --- | --- | --- |")
        parts += rows
        parts.append("")
    # NOTE: a default under the home directory (the model cache) is written as ~, so the page is
    # the same on every machine.
    return "\n".join(parts).replace(home + "/", "~/")


def _documented(action: argparse.Action) -> bool:
    return (
        not isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)) and action.help != argparse.SUPPRESS
    )


def _row(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    flag = ", ".join(f"`{s}`" for s in action.option_strings) or f"`{action.dest}` (positional)"
    if action.choices is not None and not isinstance(action.choices, dict):
        flag += " " + "/".join(f"`{c}`" for c in action.choices)
    # (the plain formatter: --help's own appends "(default: ...)", which the table has a column for)
    meaning = argparse.HelpFormatter(parser.prog)._expand_help(action) if action.help else ""
    if action.required:
        meaning = "Required. " + meaning
    return f"| {flag} | {_default(action)} | {_cell(meaning)} |"


def _default(action: argparse.Action) -> str:
    default = action.default
    if not action.option_strings or default is None or default is argparse.SUPPRESS:
        return "—"
    if default is False and action.nargs == 0:
        return "off"
    if default is True and action.nargs == 0:
        return "on"
    if isinstance(default, (tuple, list)):
        return " ".join(f"`{d}`" for d in default) if default else "—"
    return f"`{default}`" if str(default) != "" else "—"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


if __name__ == "__main__":
    sys.stdout.write(render())
