"""The user docs and the command lines, checked for what a user cannot follow.

README.md and docs/*.md describe the system as it is, for someone with only this repository: no
issue numbers, no commit hashes, no paths outside the repository (what was compared is said in
words: "before the shared decode call", not a hash). Every command's `--help` shows its options'
defaults.
"""

import argparse
import re
from pathlib import Path

import pytest

from pdserve.common.cli import build_parser as pdserve_parser
from pdserve.common.serving.server_cli import build_parser as server_parser
from pdserve.router.cli import build_parser as router_parser

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

URL = re.compile(r"\b[a-z][a-z0-9+.-]*://\S+")
FORBIDDEN = {
    # "issue 17", "issues 17 and 18", "Issue #4"
    "issue number": re.compile(r"\bissues?\s+#?\d+", re.IGNORECASE),
    # A git hash, abbreviated (7+) or whole (40): lowercase hex with at least one digit and one letter
    # a-f, a word of its own. Not part of a longer word or number (0x1f2e3d4c, 123e4567-e89b-...),
    # a hex colour (#a1b2c3d) or a URL (URLs are removed before the search).
    "commit hash": re.compile(r"(?<![\w#-])(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}(?![\w-])"),
    # Paths of the machine the docs were written on, not of the repository. `../pdserve/...` is the
    # repository seen from a directory beside its checkout (docs/operations.md's kustomize overlay).
    "path outside the repository": re.compile(
        r"(?<![\w.])\.\./(?!pdserve/)|(?<![\w.])/work/|\bshared/seeds\b|(?<![\w.])/(?:home|Users)/\w|(?<![\w.])/root/"
    ),
}


def matches(line: str) -> list[tuple[str, str]]:
    text = URL.sub("", line)
    return [(what, m.group()) for what, pattern in FORBIDDEN.items() for m in pattern.finditer(text)]


@pytest.mark.parametrize("path", DOCS, ids=[str(p.relative_to(ROOT)) for p in DOCS])
def test_docs_have_no_issue_numbers_hashes_or_outside_paths(path):
    found = [
        f"{path.relative_to(ROOT)}:{number}: {what} {match!r}: {line.strip()}"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        for what, match in matches(line)
    ]
    assert found == []


@pytest.mark.parametrize(
    "line",
    [
        "before issue 17 the router",
        "(Issues 35, first step)",
        "commit `b797d07`",
        "before (917d3b7)",
        "a73558b.",
        "see ../shared/STYLE.md",
        "/work/main/README.md",
        "shared/seeds/loop.py",
        "/home/alice/pdserve",
    ],
)
def test_the_checks_catch(line):
    assert matches(line)


@pytest.mark.parametrize(
    "line",
    [
        "https://github.com/org/repo/commit/917d3b7a",
        "colour #a1b2c3d and 0x1f2e3d4c",
        "uuid 123e4567-e89b-12d3-a456-426614174000",
        "128256 tokens, 2026-11-25, cu130, sm_90, blake2b, 1e-6",
        "resources: [../pdserve/deploy/k8s/overlays/gpu]",
        "`$PDSERVE_CACHE` (default `~/.cache/pdserve`), /tmp/lmeval, /models/Llama-3.2-1B",
        "the issue's target, router/workers.py",
    ],
)
def test_the_checks_let_pass(line):
    assert matches(line) == []


def _commands() -> dict[str, argparse.ArgumentParser]:
    """Every command's parser, sub-commands included, by the command line that shows its help."""
    commands = {}

    def walk(name: str, parser: argparse.ArgumentParser) -> None:
        commands[name] = parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub, child in action.choices.items():
                    walk(f"{name} {sub}", child)

    walk("pdserve", pdserve_parser())
    walk("pdserve-router", router_parser())
    walk("prefill-server", server_parser("prefill"))
    walk("decode-server", server_parser("decode"))
    return commands


COMMANDS = _commands()


def _says_something(default) -> bool:
    if default is None or default is False or default is argparse.SUPPRESS:
        return False
    return not (isinstance(default, (str, tuple, list)) and not default)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_help_shows_every_default(command):
    parser = COMMANDS[command]
    assert parser.format_help()  # renders: a '%' in a help text would raise here
    formatter = parser._get_formatter()  # the help text of one option, as format_help writes it
    missing = [
        action.option_strings[0]
        for action in parser._actions
        if action.option_strings and _says_something(action.default)
        if "(default: " not in formatter._expand_help(action) and "%(default)" not in (action.help or "")
    ]
    assert missing == [], f"`{command} --help` shows no default for {missing}"
