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
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

URL = re.compile(r"\b[a-z][a-z0-9+.-]*://\S+")
FORBIDDEN = {
    # "issue 17", "issues 17 and 18", "Issue #4"
    "issue number": re.compile(r"\bissues?\s+#?\d+", re.IGNORECASE),
    # A git hash, abbreviated (7+) or whole (40): lowercase hex with at least one digit and one letter
    # a-f, a word of its own. Not part of a longer word or number (0x1f2e3d4c, 123e4567-e89b-...),
    # a hex colour (#a1b2c3d) or a URL (URLs are removed before the search).
    "commit hash": re.compile(r"(?<![\w#-])(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}(?![\w-])"),
    # Paths of the machine the docs were written on, not of the repository. `../pdserve/...` is the
    # repository seen from a directory beside its checkout (docs/deploy/kubernetes.md's kustomize overlay).
    "path outside the repository": re.compile(
        r"(?<![\w.])\.\./(?!pdserve/)|(?<![\w.])/work/|\bshared/seeds\b|(?<![\w.])/(?:home|Users)/\w|(?<![\w.])/root/"
    ),
}


def matches(line: str) -> list[tuple[str, str]]:
    text = URL.sub("", line)
    return [(what, m.group()) for what, pattern in FORBIDDEN.items() for m in pattern.finditer(text)]


def _links_inside_removed(path: Path, line: str) -> str:
    """The line without its Markdown link targets that stay inside the repository (`../features/fp8.md`
    from docs/deploy/ is a page of this repository, not a path of the machine the docs were written on)."""

    def inside(m: re.Match) -> str:
        target = (path.parent / m.group(1).partition("#")[0]).resolve()
        return "]()" if target.is_relative_to(ROOT) else m.group(0)

    return re.sub(r"\]\(([^)\s]+)\)", inside, line)


@pytest.mark.parametrize("path", DOCS, ids=[str(p.relative_to(ROOT)) for p in DOCS])
def test_docs_have_no_issue_numbers_hashes_or_outside_paths(path):
    found = [
        f"{path.relative_to(ROOT)}:{number}: {what} {match!r}: {line.strip()}"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        for what, match in matches(_links_inside_removed(path, line))
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


# A page under docs/ named, then a comma and a quoted title (the title may run onto the next line, after a
# comment's `#`): a citation of a section, in code, manifests and docs alike. The title must begin a
# heading of that page, or a paragraph's or a list item's bold lead (`- **The overlapped verify step**
# (...)`).
CITATION = re.compile(r'\b(docs/[\w/.-]+\.md), (?:#\s*)?"([^"]+?)(?:"|$)', re.MULTILINE)
CITING = [
    p
    for pattern in ("*.py", "*.md", "*.yaml", "*.sh", "Dockerfile")
    for p in ROOT.rglob(pattern)
    if not {".venv", ".git", "build"} & set(p.relative_to(ROOT).parts)
]


def _headings(page: Path) -> list[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.MULTILINE | re.DOTALL)
    found = re.findall(r"^#+ (.+)$|^(?:- )?\*\*(.+?)\*\*", text, re.MULTILINE)
    return [" ".join((heading or lead).replace("`", "").split()) for heading, lead in found]


def test_every_cited_section_exists():
    broken = []
    for path in CITING:
        for match in CITATION.finditer(path.read_text()):
            page, title = ROOT / match.group(1), " ".join(match.group(2).replace("`", "").split())
            title = title.rstrip(" ,.")
            if not page.exists():
                broken.append(f"{path.relative_to(ROOT)}: {match.group(1)} does not exist")
            elif not any(h.startswith(title) for h in _headings(page)):
                broken.append(f"{path.relative_to(ROOT)}: no heading {title!r} in {match.group(1)}")
    assert broken == []


def test_every_relative_link_in_the_docs_resolves():
    broken = []
    for path in DOCS:
        for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
            file = target.partition("#")[0]
            if file and not re.match(r"[a-z]+:", file) and not (path.parent / file).exists():
                broken.append(f"{path.relative_to(ROOT)}: {target}")
    assert broken == []
