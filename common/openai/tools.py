"""OpenAI tool calling, request side: `tools` and `tool_choice` validated, and the grammar that
forces a call. The answer's calls are read back out of the text by tool_parser.py.

Calls are Hermes style, what the Qwen2.5/Qwen3, SmolLM3 and Hermes chat templates teach a model:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

What each tool_choice does (decided here, as vLLM does unless said):
- "none": no grammar, no parsing, and the tools are NOT rendered into the prompt (vLLM renders them
  unless --exclude-tools-when-tool-choice-none): a model told of tools it may not call writes calls
  anyway, and they would reach the client as raw <tool_call> text.
- "auto" (the default with tools): tools rendered; no grammar, the model decides; calls parsed.
- "required" / {"type": "function", "function": {"name": X}}: tools rendered, and an xgrammar
  structural tag (SamplingParams.grammar = ("structural_tag", json)) makes the whole answer one or
  more calls (of X only, for a named function), arguments following the tool's `parameters`.
Templates that do not render `tools` (a plain ChatML template) ignore them; the model then knows of
the tools only through the conversation. `strict` is accepted: the forced grammars always follow
`parameters`; under "auto" nothing constrains a call's arguments (they must only parse as JSON).
`parallel_tool_calls: false` stops a forced answer after its first call; under "auto" it is not
enforced (every call the model writes is returned).

Torch- and xgrammar-free like the rest of the parser: the structural tag is built as plain JSON
(tests/test_tool_calls.py compiles it with xgrammar).
"""

from __future__ import annotations

import json
import re
from typing import Any

from pdserve.common.openai.fields import OpenAIError, _check_unicode, _json_type, _wrong_type

TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule for function names
MAX_TOOLS = 128  # OpenAI's limit; every tool is one tag of the grammar a forced call compiles
FUNCTION_FIELDS = ("name", "description", "parameters", "strict")
CALL_BEGIN, CALL_END = "<tool_call>", "</tool_call>"
CHOICES = ("none", "auto", "required")


def _tool_error(where: str, problem: str) -> OpenAIError:
    return OpenAIError(f"'{where}' {problem}", param="tools")


def _function(tool: Any, where: str) -> dict:
    """One tool's function, with its parameters defaulted; the keys given, no others."""
    if not isinstance(tool, dict):
        raise _tool_error(where, f"must be an object, got {_json_type(tool)}")
    unknown = sorted(set(tool) - {"type", "function"})
    if unknown:
        raise _tool_error(where, f"has unsupported field(s): {', '.join(unknown)}")
    if tool.get("type") != "function":
        raise _tool_error(
            f"{where}.type", f'must be "function" (the only tool type supported), got {tool.get("type")!r}'
        )
    function = tool.get("function")
    where = f"{where}.function"
    if not isinstance(function, dict):
        raise _tool_error(where, f"must be an object, got {_json_type(function)}")
    unknown = sorted(set(function) - set(FUNCTION_FIELDS))
    if unknown:
        raise _tool_error(where, f"has unsupported field(s): {', '.join(unknown)}")
    name = function.get("name")
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise _tool_error(f"{where}.name", f"must be 1 to 64 of a-z, A-Z, 0-9, _ and -, got {name!r}")
    result = {"name": name}
    if function.get("description") is not None:
        if not isinstance(function["description"], str):
            raise _tool_error(f"{where}.description", f"must be a string, got {_json_type(function['description'])}")
        result["description"] = function["description"]
    parameters = function.get("parameters")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise _tool_error(f"{where}.parameters", f"must be a JSON schema object, got {_json_type(parameters)}")
    try:  # json.loads lets NaN and Infinity through; the grammar's JSON (and JSON itself) has none
        json.dumps(parameters, allow_nan=False)
    except ValueError:
        raise _tool_error(f"{where}.parameters", "must not hold NaN or Infinity") from None
    except RecursionError:
        raise _tool_error(f"{where}.parameters", "is nested too deeply") from None
    result["parameters"] = parameters
    if function.get("strict") is not None:
        if not isinstance(function["strict"], bool):
            raise _tool_error(f"{where}.strict", f"must be a boolean, got {_json_type(function['strict'])}")
        result["strict"] = function["strict"]
    return result


def parse_tools(body: dict) -> list[dict] | None:
    """`tools` as {"type": "function", "function": {name, [description], parameters, [strict]}},
    the shape transformers' chat templates take; None when absent or empty."""
    tools = body.get("tools")
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise _wrong_type("tools", "an array of tools", tools)
    if len(tools) > MAX_TOOLS:
        raise OpenAIError(f"'tools' takes at most {MAX_TOOLS} tools, got {len(tools)}", param="tools")
    result, names = [], set()
    for i, tool in enumerate(tools):
        function = _function(tool, f"tools[{i}]")
        if function["name"] in names:
            raise _tool_error(f"tools[{i}].function.name", f"repeats {function['name']!r}; names must be unique")
        names.add(function["name"])
        result.append({"type": "function", "function": function})
    # The tools reach the prompt (the template) and the servers (the grammar) as text.
    _check_unicode(json.dumps(result, ensure_ascii=False), "tools")
    return result


def parse_tool_choice(body: dict, tools: list[dict] | None) -> str | dict:
    """ "none", "auto", "required" or {"type": "function", "function": {"name": X}} with X a tool;
    absent: "auto" with tools, "none" without."""
    choice = body.get("tool_choice")
    if choice is None:
        return "auto" if tools else "none"
    if isinstance(choice, str):
        if choice not in CHOICES:
            raise OpenAIError(
                f'\'tool_choice\' must be "none", "auto", "required" or '
                f'{{"type": "function", "function": {{"name": ...}}}}, got {choice!r}',
                param="tool_choice",
            )
    elif isinstance(choice, dict):
        function = choice.get("function")
        if (
            set(choice) != {"type", "function"}
            or choice["type"] != "function"
            or not isinstance(function, dict)
            or set(function) != {"name"}
            or not isinstance(function["name"], str)
        ):
            raise OpenAIError(
                '\'tool_choice\' as an object must be {"type": "function", "function": {"name": ...}}',
                param="tool_choice",
            )
    else:
        raise _wrong_type("tool_choice", "a string or an object", choice)
    if choice != "none" and not tools:
        raise OpenAIError(f"'tool_choice' {json.dumps(choice)} requires 'tools'", param="tool_choice")
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        if all(tool["function"]["name"] != name for tool in tools):
            raise OpenAIError(
                f"'tool_choice' names the function {name!r}, which is not in 'tools'", param="tool_choice"
            )
        return {"type": "function", "function": {"name": name}}
    return choice


def _call_tag(function: dict) -> dict:
    """One call of `function`: the tag text around its arguments, which follow its parameters.

    NOTE: at most one whitespace character in a row inside the arguments: models write `{"a": 1}`
    (one space, as the templates' tojson does), and unbounded whitespace would let a weak or
    random-weight model pad with spaces until max_tokens and never close the call."""
    arguments = {"type": "json_schema", "json_schema": function["parameters"], "max_whitespace_cnt": 1}
    return {
        "type": "tag",
        "begin": f'{CALL_BEGIN}\n{{"name": {json.dumps(function["name"])}, "arguments": ',
        "content": arguments,
        "end": f"}}\n{CALL_END}",
    }


def forced_call_grammar(tools: list[dict] | None, choice: str | dict, parallel: bool) -> tuple[str, str] | None:
    """SamplingParams.grammar forcing calls: "required" (one or more calls of any tool, separated
    by newlines, nothing else; one when not `parallel`) or a named function (one call of it).
    None for "none" and "auto"."""
    if isinstance(choice, dict):
        [function] = [t["function"] for t in tools if t["function"]["name"] == choice["function"]["name"]]
        form = _call_tag(function)
    elif choice == "required":
        # NOTE: tags_with_separator, not triggered_tags: it admits no text before the first call,
        # so even a model that would rather talk (or a random-weight one) writes a call at once.
        form = {
            "type": "tags_with_separator",
            "tags": [_call_tag(t["function"]) for t in tools],
            "separator": "\n",
            "at_least_one": True,
            "stop_after_first": not parallel,
        }
    else:
        return None
    return "structural_tag", json.dumps({"type": "structural_tag", "format": form})
