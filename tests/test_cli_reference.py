"""docs/reference/cli.md is the parsers' own word: regenerated from the code, it must equal the committed
page (`make cli-reference` rewrites it), and a default changed in the code without the page fails here."""

import argparse
from pathlib import Path

from pdserve.router import cli_reference

PAGE = Path(__file__).resolve().parents[1] / "docs" / "reference" / "cli.md"


def test_the_committed_reference_is_what_the_code_says():
    assert PAGE.read_text() == cli_reference.render(), (
        "docs/reference/cli.md is out of date with the command-line parsers: run `make cli-reference`"
    )


def test_every_command_and_flag_of_help_is_on_the_page():
    page = PAGE.read_text()
    for name, parser, _ in cli_reference.commands():
        flags = [
            a.option_strings[-1]
            for a in parser._actions
            if a.option_strings and a.help != argparse.SUPPRESS and not isinstance(a, argparse._HelpAction)
        ]
        if flags:
            assert f"## `{name}`" in page
        for flag in flags:
            assert f"`{flag}`" in page, f"{name} {flag}"
    for name in ("prefill-server", "pdserve-router", "pdserve up", "pdserve bench serve", "pdserve bench transfer"):
        assert f"## `{name}`" in page


def test_a_default_changed_in_the_code_alone_fails_the_check(monkeypatch):
    real = cli_reference.commands

    def page_size_32():
        found = real()
        for action in found[0][1]._actions:  # prefill-server
            if "--page-size" in action.option_strings:
                action.default = 32
        return found

    monkeypatch.setattr(cli_reference, "commands", page_size_32)
    rendered = cli_reference.render()
    assert rendered != PAGE.read_text()
    assert "| `--page-size` | `32` |" in rendered and "| `--page-size` | `16` |" in PAGE.read_text()
