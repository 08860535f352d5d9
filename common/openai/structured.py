"""Structured-output request fields -> SamplingParams.grammar (kind, spec).

OpenAI's `response_format` ({"type": "text" | "json_object" | "json_schema"}), and vLLM's
`structured_outputs` ({"json" | "regex" | "choice" | "grammar" | "json_object" | "structural_tag"})
and its older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`. At most one
constraint per request. Torch-free like the rest of the API layer: only the shape is checked here;
the servers compile the grammar (common/engine/grammar.py) and a grammar the library refuses comes
back as a 400 with its reason.
"""

from __future__ import annotations

import json
from typing import Any

from pdserve.common.openai.fields import OpenAIError, _check_unicode, _wrong_type

# vLLM's names, accepted on both endpoints.
GUIDED_FIELDS = frozenset({
    "guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
    "guided_whitespace_pattern", "structured_outputs",
})  # fmt: skip
MAX_SPEC_CHARS = 256 * 1024
MAX_CHOICES = 1024
# Backends a client may name: this server has one, and asking for it by name is harmless.
BACKENDS = ("xgrammar", "auto")


def grammar_of(body: dict) -> tuple[str, str] | None:
    """The request's grammar, or None when it asks for no constraint. Raises OpenAIError."""
    found = []  # (param, grammar)
    response_format = _response_format(body.get("response_format"))
    if response_format is not None:
        found.append(("response_format", response_format))
    found += _guided(body)
    found += _structured_outputs(body.get("structured_outputs"))
    if len(found) > 1:
        names = ", ".join(sorted({param for param, _ in found}))
        raise OpenAIError(
            f"give at most one structured-output constraint; this request has several ({names})", param=found[1][0]
        )
    backend = body.get("guided_decoding_backend")
    if backend is not None and backend not in BACKENDS:
        raise OpenAIError(
            f"'guided_decoding_backend' {backend!r} is not available; this server uses xgrammar",
            param="guided_decoding_backend",
        )
    if body.get("guided_whitespace_pattern") is not None:
        raise OpenAIError(
            "'guided_whitespace_pattern' is not supported (JSON is generated without free whitespace)",
            param="guided_whitespace_pattern",
        )
    return found[0][1] if found else None


def _response_format(value: Any) -> tuple[str, str] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _wrong_type("response_format", "an object", value)
    kind = value.get("type")
    known = {"text": {"type"}, "json_object": {"type"}, "json_schema": {"type", "json_schema"}}
    if kind not in known:
        raise OpenAIError(
            f"'response_format.type' must be one of text, json_object, json_schema; got {kind!r}",
            param="response_format",
        )
    unknown = sorted(set(value) - known[kind])
    if unknown:
        raise OpenAIError(f"unknown field(s) in 'response_format': {', '.join(unknown)}", param="response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return ("json_object", "")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise _wrong_type("response_format.json_schema", "an object", spec)
    unknown = sorted(set(spec) - {"name", "description", "schema", "strict"})
    if unknown:
        raise OpenAIError(
            f"unknown field(s) in 'response_format.json_schema': {', '.join(unknown)}", param="response_format"
        )
    name = spec.get("name")
    if not isinstance(name, str) or not name:
        raise OpenAIError("'response_format.json_schema.name' is required (a string)", param="response_format")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise _wrong_type("response_format.json_schema.strict", "a boolean", strict)
    if "schema" not in spec:  # OpenAI: the schema is what the output must follow; without it, any JSON object
        return ("json_object", "")
    return ("json_schema", _schema_text(spec["schema"], "response_format"))


def _schema_text(schema: Any, param: str) -> str:
    """A JSON schema (an object, or its JSON text) as compact JSON text; key order kept (it is the
    order the output's properties follow)."""
    if isinstance(schema, str):
        _check_unicode(schema, param)
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise OpenAIError(f"'{param}' is not valid JSON: {e}", param=param) from None
    if not isinstance(schema, (dict, bool)):
        raise _wrong_type(param, "a JSON schema (an object)", schema)
    return _limited(json.dumps(schema, ensure_ascii=False, separators=(",", ":")), param)


def _limited(text: str, param: str) -> str:
    _check_unicode(text, param)
    if len(text) > MAX_SPEC_CHARS:
        raise OpenAIError(f"'{param}' is too long: {len(text)} characters, at most {MAX_SPEC_CHARS}", param=param)
    return text


def _string(value: Any, param: str) -> str:
    if not isinstance(value, str) or not value:
        raise _wrong_type(param, "a non-empty string", value)
    return _limited(value, param)


def _choices(value: Any, param: str) -> tuple[str, str]:
    if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
        raise _wrong_type(param, "a non-empty array of non-empty strings", value)
    if len(value) > MAX_CHOICES:
        raise OpenAIError(f"'{param}' takes at most {MAX_CHOICES} choices, got {len(value)}", param=param)
    return ("ebnf", _limited(choice_ebnf(value), param))


def choice_ebnf(choices: list[str]) -> str:
    """Exactly one of the strings, as EBNF (JSON string escapes are EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _guided(body: dict) -> list[tuple[str, tuple[str, str]]]:
    found = []
    if body.get("guided_json") is not None:
        found.append(("guided_json", ("json_schema", _schema_text(body["guided_json"], "guided_json"))))
    if body.get("guided_regex") is not None:
        found.append(("guided_regex", ("regex", _string(body["guided_regex"], "guided_regex"))))
    if body.get("guided_choice") is not None:
        found.append(("guided_choice", _choices(body["guided_choice"], "guided_choice")))
    if body.get("guided_grammar") is not None:
        found.append(("guided_grammar", ("ebnf", _string(body["guided_grammar"], "guided_grammar"))))
    return found


def _structured_outputs(value: Any) -> list[tuple[str, tuple[str, str]]]:
    """vLLM's `structured_outputs` object: exactly one of its constraint fields."""
    if value is None:
        return []
    if not isinstance(value, dict):
        raise _wrong_type("structured_outputs", "an object", value)
    param = "structured_outputs"
    known = {
        "json",
        "regex",
        "choice",
        "grammar",
        "json_object",
        "structural_tag",
        "disable_any_whitespace",
        "disable_additional_properties",
        "whitespace_pattern",
    }
    unknown = sorted(set(value) - known)
    if unknown:
        raise OpenAIError(f"unknown field(s) in 'structured_outputs': {', '.join(unknown)}", param=param)
    if value.get("whitespace_pattern") is not None:
        raise OpenAIError("'structured_outputs.whitespace_pattern' is not supported", param=param)
    for flag in ("disable_any_whitespace", "disable_additional_properties"):  # what this server always does
        if value.get(flag) is not None and not isinstance(value[flag], bool):
            raise _wrong_type(f"structured_outputs.{flag}", "a boolean", value[flag])
    found = []
    if value.get("json") is not None:
        found.append(("json", ("json_schema", _schema_text(value["json"], "structured_outputs.json"))))
    if value.get("regex") is not None:
        found.append(("regex", ("regex", _string(value["regex"], "structured_outputs.regex"))))
    if value.get("choice") is not None:
        found.append(("choice", _choices(value["choice"], "structured_outputs.choice")))
    if value.get("grammar") is not None:
        found.append(("grammar", ("ebnf", _string(value["grammar"], "structured_outputs.grammar"))))
    if value.get("json_object") is not None:
        if not isinstance(value["json_object"], bool):
            raise _wrong_type("structured_outputs.json_object", "a boolean", value["json_object"])
        if value["json_object"]:
            found.append(("json_object", ("json_object", "")))
    if value.get("structural_tag") is not None:
        tag = value["structural_tag"]
        text = tag if isinstance(tag, str) else json.dumps(tag, ensure_ascii=False) if isinstance(tag, dict) else None
        if text is None:
            raise _wrong_type("structured_outputs.structural_tag", "an object or its JSON text", tag)
        found.append(("structural_tag", ("structural_tag", _limited(text, "structured_outputs.structural_tag"))))
    if len(found) > 1:
        raise OpenAIError(
            f"'structured_outputs' takes one constraint, got {', '.join(name for name, _ in found)}", param=param
        )
    return [(param, grammar) for _, grammar in found]
