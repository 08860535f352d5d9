"""A grammar spec (kind, text) parsed into an xgrammar Grammar: the server compiles it to check it
(common/engine/grammar.py), and its grammar worker (common/engine/grammar_worker.py) compiles its own copy."""

from __future__ import annotations

import re

MAX_ERROR_CHARS = 400
# xgrammar's messages start with "[03:59:31] /project/cpp/regex_converter.cc:83: " and may hold
# "Check failed: (...) is false: ": noise for the client.
_LOCATION = re.compile(r"\[[\d:]+\] \S+:\d+: |Check failed: \(.*?\) is false: ")


def grammar_source(xgr, kind: str, spec: str):
    """(kind, spec) parsed into an xgrammar Grammar (or its EBNF text); ValueError, with the
    library's reason, if refused. (The server and its grammar worker both call this.)"""
    try:
        if kind == "json_object":
            return bounded_numbers(str(xgr.Grammar.builtin_json_grammar()))
        if kind == "json_schema":
            # Compact JSON (no free whitespace): a weak or random model could otherwise emit
            # whitespace until max_tokens and never close the object. strict_mode: no
            # properties or items beyond the schema's, as OpenAI's strict mode.
            return bounded_numbers(
                _no_raw_control_characters(xgr.Grammar.from_json_schema(spec, any_whitespace=False, strict_mode=True))
            )
        if kind == "regex":
            return xgr.Grammar.from_regex(spec)
        if kind == "ebnf":
            return xgr.Grammar.from_ebnf(spec)
        if kind == "structural_tag":
            return bounded_numbers(_no_raw_control_characters(xgr.Grammar.from_structural_tag(spec)))
    except Exception as e:  # xgrammar raises RuntimeError, ValueError or its own InvalidJSONError
        reason = _LOCATION.sub("", " ".join(str(e).split()))[:MAX_ERROR_CHARS]
        raise ValueError(f"the {kind} grammar cannot be compiled: {reason}") from None
    raise ValueError(f"unknown grammar kind {kind!r}")


# xgrammar 0.2.8 writes a string with maxLength as `[^"\\\r\n]{0, n}`: raw control characters
# (U+0000-U+001F other than CR and LF) are allowed there, which JSON forbids (json.loads and
# JSON.parse refuse the output; its unbounded strings exclude them). The class is rewritten as
# its unbounded strings have it.
_LOOSE_STRING_CHARACTER = '[^\\"\\\\\\r\\n]'
_JSON_STRING_CHARACTER = '[^\\0-\\x1f\\"\\\\]'


def _no_raw_control_characters(grammar) -> str:
    """The grammar's EBNF with JSON's rule for string characters everywhere."""
    return str(grammar).replace(_LOOSE_STRING_CHARACTER, _JSON_STRING_CHARACTER)


# A number's digits, bounded: a weak model otherwise writes "2000000000000000000000..." until
# max_tokens inside an integer the schema leaves unbounded. At most 20 digits before the point (an
# int64 has 19), 20 after it, 3 in an exponent. A schema's own minimum/maximum become xgrammar range
# rules, which these patterns do not match. The patterns are xgrammar 0.2.8's (pinned in
# pyproject.toml); tests/test_structured_outputs.py fails if a newer one writes numbers otherwise.
MAX_INTEGER_DIGITS, MAX_FRACTION_DIGITS, MAX_EXPONENT_DIGITS = 20, 20, 3


def bounded_numbers(ebnf: str) -> str:
    """`ebnf` with every JSON number's digit runs bounded (see above)."""
    lines = []
    for line in ebnf.splitlines():
        line = line.replace("[1-9] [0-9]*", f"[1-9] [0-9]{{0, {MAX_INTEGER_DIGITS - 1}}}")
        if '"."' in line:  # a fraction: the builtin JSON grammar's, or from_json_schema's digit rule
            line = line.replace("[0-9] [0-9]*", f"[0-9] [0-9]{{0, {MAX_FRACTION_DIGITS - 1}}}")
            line = line.replace("{1, -1}", f"{{1, {MAX_FRACTION_DIGITS}}}")
        if "[eE]" in line or '("e" sign' in line or '("E" sign' in line:  # an exponent
            line = line.replace("[0-9] [0-9]*", f"[0-9] [0-9]{{0, {MAX_EXPONENT_DIGITS - 1}}}")
            line = line.replace("{1, -1}", f"{{1, {MAX_EXPONENT_DIGITS}}}")
        lines.append(line)
    return "\n".join(lines)
