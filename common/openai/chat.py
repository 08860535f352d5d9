"""Chat completion requests: messages and their content, validated into a ParsedRequest with the
chat template applied (the shared field rules are in api.py)."""

from __future__ import annotations

import json
from typing import Any

# The field rules both endpoints share (package-internal: api.py and this module are one parser).
from pdserve.common.openai.api import (
    CHAT_FIELDS,
    CHAT_ROLES,
    ParsedRequest,
    _build,
    _max_tokens,
    _shared,
    _tokenize,
    check_fan_out,
)
from pdserve.common.openai.defaults import GenerationDefaults
from pdserve.common.openai.fields import OpenAIError, _boolean, _integer, _json_type, _reject_unless_empty, _wrong_type
from pdserve.common.openai.tools import CALL_BEGIN, CALL_END, forced_call_grammar, parse_tool_choice, parse_tools
from pdserve.common.types import MAX_TOP_LOGPROBS


def _message_error(index: int, problem: str) -> OpenAIError:
    return OpenAIError(f"'messages[{index}]{problem}", param="messages")


def _message_content(content: Any, index: int) -> str:
    """A string, or text parts joined with ""."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _message_error(index, f".content' must be a string or an array of text parts, got {_json_type(content)}")
    for part in content:
        if not isinstance(part, dict) or set(part) != {"type", "text"} or part["type"] != "text":
            raise _message_error(index, '.content\' parts must be {"type": "text", "text": ...} (only text)')
        if not isinstance(part["text"], str):
            raise _message_error(index, f".content' part text must be a string, got {_json_type(part['text'])}")
    return "".join(part["text"] for part in content)


# The roles of api.py, and "tool": a tool's result, answering an assistant's call by its id.
ROLES = CHAT_ROLES | {"tool": "tool"}
MESSAGE_FIELDS = {"role", "content", "name", "tool_calls", "tool_call_id"}


def _call_arguments(arguments: Any, where: str, index: int) -> dict:
    """A call's arguments as a dict, as chat templates take them (they write `arguments | tojson`);
    the OpenAI API sends them as a string of JSON."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            raise _message_error(index, f"{where}.function.arguments' must be a JSON object (as a string)") from None
    if not isinstance(arguments, dict):
        raise _message_error(index, f"{where}.function.arguments' must be a JSON object, got {_json_type(arguments)}")
    return arguments


def _tool_calls(calls: Any, index: int) -> list[dict]:
    """An assistant's earlier calls: {id, type: "function", function: {name, arguments: dict}}."""
    if not isinstance(calls, list):
        raise _message_error(index, f".tool_calls' must be an array, got {_json_type(calls)}")
    result = []
    for j, call in enumerate(calls):
        where = f".tool_calls[{j}]"
        if (
            not isinstance(call, dict)
            or call.get("type", "function") != "function"
            or not isinstance(call.get("function"), dict)
        ):
            raise _message_error(index, f'{where}\' must be {{"id", "type": "function", "function": {{...}}}}')
        for part, fields, allowed in (
            (where, call, {"id", "type", "function"}),
            (f"{where}.function", call["function"], {"name", "arguments"}),
        ):
            unknown = sorted(set(fields) - allowed)
            if unknown:
                raise _message_error(index, f"{part}' has unsupported field(s): {', '.join(unknown)}")
        if not isinstance(call.get("id"), str):
            raise _message_error(index, f"{where}.id' must be a string, got {_json_type(call.get('id'))}")
        function = call["function"]
        if not isinstance(function.get("name"), str):
            raise _message_error(
                index, f"{where}.function.name' must be a string, got {_json_type(function.get('name'))}"
            )
        arguments = _call_arguments(function.get("arguments"), where, index)
        result.append(
            {"id": call["id"], "type": "function", "function": {"name": function["name"], "arguments": arguments}}
        )
    return result


def _chat_messages(messages: Any) -> list[dict]:
    """The conversation as the chat template sees it: {role, content: str[, name]}; an assistant's
    calls as `tool_calls` (arguments a dict) with content "" when it had none (as vLLM); a tool's
    result as {role: "tool", content, tool_call_id}."""
    if messages is None:
        raise OpenAIError("'messages' is required", param="messages")
    if not isinstance(messages, list):
        raise _wrong_type("messages", "an array", messages)
    if not messages:
        raise OpenAIError("'messages' must not be empty", param="messages")
    result = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise _message_error(i, f"' must be an object, got {_json_type(message)}")
        unknown = sorted(set(message) - MESSAGE_FIELDS)
        if unknown:
            raise _message_error(i, f"' has unsupported field(s): {', '.join(unknown)}")
        role = message.get("role")
        if not isinstance(role, str) or role not in ROLES:  # (a dict or a list is not hashable)
            raise _message_error(i, f".role' must be one of {', '.join(ROLES)}, got {role!r}")
        calls = []
        if message.get("tool_calls") is not None:
            if role != "assistant":
                raise _message_error(i, ".tool_calls' is only allowed on assistant messages")
            calls = _tool_calls(message["tool_calls"], i)
        if message.get("content") is None and not calls:
            raise _message_error(i, ".content' is required")
        content = message.get("content")
        entry = {"role": ROLES[role], "content": "" if content is None else _message_content(content, i)}
        if calls:
            entry["tool_calls"] = calls
        if role == "tool":
            if not isinstance(message.get("tool_call_id"), str):
                raise _message_error(
                    i,
                    f".tool_call_id' must be a string (the call answered), got "
                    f"{_json_type(message.get('tool_call_id'))}",
                )
            entry["tool_call_id"] = message["tool_call_id"]
        elif message.get("tool_call_id") is not None:
            raise _message_error(i, ".tool_call_id' is only allowed on tool messages")
        if message.get("name") is not None:
            if not isinstance(message["name"], str):
                raise _message_error(i, f".name' must be a string, got {_json_type(message['name'])}")
            entry["name"] = message["name"]
        result.append(entry)
    return result


def _chat_logprobs(body: dict) -> int | None:
    wanted = _boolean(body, "logprobs", False)
    top = _integer(
        body, "top_logprobs", None, lambda v: 0 <= v <= MAX_TOP_LOGPROBS, f"between 0 and {MAX_TOP_LOGPROBS}"
    )
    if top is not None and not wanted:
        raise OpenAIError("'top_logprobs' requires 'logprobs' to be true", param="top_logprobs")
    return (top or 0) if wanted else None


def _chat_max_tokens(body: dict) -> int | None:
    legacy, current = _max_tokens(body, "max_tokens"), _max_tokens(body, "max_completion_tokens")
    if legacy is not None and current is not None and legacy != current:
        raise OpenAIError("'max_tokens' and 'max_completion_tokens' disagree; give one", param="max_tokens")
    return current if current is not None else legacy


def _keep_call_tags(body: dict, shared: dict, tokenizer) -> None:
    """A tokenizer that makes "<tool_call>" a special token would have skip_special_tokens erase the
    tags the calls are parsed by (vLLM's Hermes parser turns it off too); a client's own setting wins.

    NOTE: decode skips every added token marked special, not only those in all_special_tokens."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    if body.get("skip_special_tokens") is None and any(
        getattr(token, "special", False) and str(token) == CALL_BEGIN for token in added.values()
    ):
        shared["sampling"]["skip_special_tokens"] = False


def _render(tokenizer, messages: list[dict], tools: list[dict] | None, **prompt) -> str:
    """The conversation through the chat template, with `tools` told to the model: by the template
    where it renders them, else by tools_prompt() in a system message (a template without tools
    support ignores `tools`: they would be dropped without a word). `prompt`: the template's
    add_generation_prompt / continue_final_message (default: a generation prompt, as a chat request's)."""
    text = _apply_template(tokenizer, messages, None, **prompt)
    if tools is None:
        return text
    with_tools = _apply_template(tokenizer, messages, tools, **prompt)
    if with_tools != text:
        return with_tools
    return _apply_template(tokenizer, with_tools_prompt(messages, tools), None, **prompt)


def _apply_template(tokenizer, messages: list[dict], tools: list[dict] | None, **prompt) -> str:
    prompt = {"add_generation_prompt": True} | prompt
    try:  # tools=None renders as before tools existed
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, **prompt)
    except Exception as e:  # templates raise (jinja's raise_exception) on conversations they refuse
        raise OpenAIError(f"the chat template rejected the messages: {e}", param="messages") from None


def with_tools_prompt(messages: list[dict], tools: list[dict]) -> list[dict]:
    """`messages` with tools_prompt(tools) closing the system message (a new one first, if none)."""
    prompt = tools_prompt(tools)
    if messages and messages[0]["role"] == "system":
        first = dict(messages[0], content=f"{messages[0]['content']}\n\n{prompt}")
        return [first, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]


def tools_prompt(tools: list[dict]) -> str:
    """The tools and how to call them, in the Hermes format (Qwen2.5's and Hermes' templates teach
    it; tool_parser.py reads it back): what a template without tools support gets instead."""
    listed = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{listed}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        f"{CALL_BEGIN}{CALL_END} XML tags:\n{CALL_BEGIN}\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n'
        f"{CALL_END}"
    )


def parse_chat_request(
    body: dict, tokenizer, served_model_name: str, max_context_len: int, *, allow_stream: bool = False,
    max_choices: int | None = None, vocab_size: int | None = None, defaults: GenerationDefaults | None = None,
    aliases: tuple[str, ...] = (),
) -> ParsedRequest:  # fmt: skip
    """Validate a /v1/chat/completions body and render its conversation. Raises OpenAIError.

    `max_choices`, `vocab_size`, `defaults` and `aliases` as in parse_completion_request. Tools: see
    tools.py (the legacy `functions` and `function_call` are refused unless they ask for nothing:
    their answer has another shape, message.function_call)."""
    vocab_size = len(tokenizer) if vocab_size is None else vocab_size
    shared = _shared(body, served_model_name, CHAT_FIELDS, allow_stream, vocab_size, defaults, aliases)
    check_fan_out(1, shared["n"], max_choices, "n")
    structured = shared.get("grammar")  # response_format and vLLM's structured outputs (structured.py)
    _reject_unless_empty(body, "functions")
    _reject_unless_empty(body, "function_call", allowed=("none",))
    tools = parse_tools(body)
    tool_choice = parse_tool_choice(body, tools)
    forced = forced_call_grammar(tools, tool_choice, _boolean(body, "parallel_tool_calls", True))
    if forced is not None and structured is not None:
        raise OpenAIError(
            "cannot combine a structured-output constraint ('response_format', 'structured_outputs' or "
            "'guided_*') with a 'tool_choice' that forces a call (\"required\" or a named function): "
            "both constrain the whole answer",
            param="tool_choice",
        )
    if tool_choice != "none":
        _keep_call_tags(body, shared, tokenizer)
    logprobs = _chat_logprobs(body)
    max_tokens = _chat_max_tokens(body)
    messages = _chat_messages(body.get("messages"))
    if not getattr(tokenizer, "chat_template", None):
        raise OpenAIError("this model has no chat template; use /v1/completions")
    text = _render(tokenizer, messages, tools if tool_choice != "none" else None)
    # The template already carries BOS; adding special tokens again would double it.
    prompt = _tokenize(tokenizer, text, False, "messages")
    return _build(
        "chat", shared, served_model_name, [prompt], [text], max_tokens, logprobs, max_context_len,
        grammar=forced or structured, messages=messages, tools=tools, tool_choice=tool_choice,
    )  # fmt: skip
