"""OpenAI's Responses API (POST /v1/responses) as a translation of the chat endpoint: a Responses
body becomes a chat body (`chat_body`), which is served as any chat request (the same validation,
chat template, grammars, tools and router path), and the chat answer becomes a Response object
(`response_object`; streamed: router/responses_routes.py turns the chat chunks into the Responses
events with `ResponseEvents`). So a conversation's greedy text is the chat endpoint's, by
construction.

    input: a string (one user message), or items: messages ({"role", "content": str | parts}),
           {"type": "function_call", "call_id", "name", "arguments"} (the model's earlier call),
           {"type": "function_call_output", "call_id", "output"} (its result)
    instructions (a system message first), max_output_tokens, temperature, top_p, tools (function
    tools: {"type": "function", "name", "parameters", ...}), tool_choice, parallel_tool_calls,
    text.format (text, json_object, json_schema), stream, metadata, user, store

Not kept: responses are not stored (`store` is accepted, the answer says `"store": false`), so
`previous_response_id` is refused with a 400 that says to send the conversation as `input`: a store
would live in one router process (a deployment runs several, and restarts lose it) — the client
holding its conversation is the form that works behind any router.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from pdserve.common.openai.fields import OpenAIError, _json_type, _wrong_type

RESPONSE_FIELDS = frozenset(
    {
        "model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "tools", "tool_choice",
        "parallel_tool_calls", "text", "stream", "metadata", "user", "store", "previous_response_id", "truncation",
    }
)  # fmt: skip
MESSAGE_ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")


def chat_body(body: Any) -> dict:
    """The /v1/chat/completions body that serves Responses `body`. Raises OpenAIError (400)."""
    if not isinstance(body, dict):
        raise OpenAIError(f"the request body must be a JSON object, got {_json_type(body)}")
    unknown = sorted(set(body) - RESPONSE_FIELDS)
    if unknown:
        raise OpenAIError(f"unknown field(s): {', '.join(repr(u) for u in unknown)}", param=unknown[0])
    if body.get("previous_response_id") is not None:
        raise OpenAIError(
            "responses are not stored here: send the conversation so far as 'input' (its messages, "
            "function_call and function_call_output items) instead of 'previous_response_id'",
            param="previous_response_id",
        )
    if body.get("truncation") not in (None, "disabled"):
        raise OpenAIError(
            "only 'truncation': 'disabled' is served (too long a conversation gets a 400)", param="truncation"
        )
    messages = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise _wrong_type("instructions", "a string", instructions)
        messages.append({"role": "system", "content": instructions})
    messages += _messages(body.get("input"))
    chat = {"messages": messages}
    for ours, theirs in (("model", "model"), ("max_output_tokens", "max_tokens"), ("temperature", "temperature")):
        if body.get(ours) is not None:
            chat[theirs] = body[ours]
    for name in ("top_p", "parallel_tool_calls", "metadata", "user", "store", "stream"):
        if body.get(name) is not None:
            chat[name] = body[name]
    if chat.get("stream") is True:
        chat["stream_options"] = {"include_usage": True}  # for response.completed's usage
    if body.get("tools") is not None:
        chat["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    response_format = _text_format(body.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    return chat


def _messages(items: Any) -> list[dict]:
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise OpenAIError("'input' must be a string or a non-empty array of items", param="input")
    messages: list[dict] = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise OpenAIError(f"'input[{i}]' must be an object, got {_json_type(item)}", param="input")
        kind = item.get("type", "message")
        if kind == "message":
            messages.append({"role": _role(item, i), "content": _content(item.get("content"), i)})
        elif kind == "function_call":
            call = {
                "id": _string(item, "call_id", i),
                "type": "function",
                "function": {"name": _string(item, "name", i), "arguments": _string(item, "arguments", i)},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)  # calls made together: one assistant turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(output, str):
                output = json.dumps(output)  # (a structured result reaches the template as its JSON)
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", i), "content": output})
        else:
            raise OpenAIError(
                f"'input[{i}].type' {kind!r} is not served (message, function_call, function_call_output)",
                param="input",
            )
    return messages


def _role(item: dict, i: int) -> str:
    role = item.get("role")
    if role not in MESSAGE_ROLES:
        raise OpenAIError(f"'input[{i}].role' must be one of {', '.join(MESSAGE_ROLES)}, got {role!r}", param="input")
    return role


def _content(content: Any, i: int) -> str | list:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise OpenAIError(f"'input[{i}].content' must be a string or an array of text parts", param="input")
    parts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise OpenAIError(
                f"'input[{i}].content' parts must be text ({', '.join(TEXT_PARTS)}) with a string 'text'",
                param="input",
            )
        parts.append({"type": "text", "text": part["text"]})
    return parts


def _string(item: dict, name: str, i: int) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise OpenAIError(f"'input[{i}].{name}' must be a string, got {_json_type(value)}", param="input")
    return value


def _tools(tools: Any) -> list[dict]:
    if not isinstance(tools, list):
        raise _wrong_type("tools", "an array", tools)
    chat_tools = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise OpenAIError(f'\'tools[{i}]\' must be a function tool ({{"type": "function", ...}})', param="tools")
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        chat_tools.append({"type": "function", "function": function})
    return chat_tools


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice  # "auto", "none", "required"; anything else is the chat parser's to refuse


def _text_format(text: Any) -> dict | None:
    if text is None:
        return None
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"}:
        raise OpenAIError("'text' must be an object with a 'format'", param="text")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise OpenAIError("'text.format.type' must be text, json_object or json_schema", param="text")
    if fmt["type"] != "json_schema":
        return {"type": fmt["type"]}
    schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
    return {"type": "json_schema", "json_schema": schema}


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


def response_object(body: dict, response_id: str, created: int, model: str, status: str = "in_progress") -> dict:
    """A Response as it starts (no output yet); `finish` completes it."""
    return {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "status": status,
        "model": model,
        "output": [],
        "usage": None,
        "error": None,
        "incomplete_details": None,
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "tools": body.get("tools") or [],
        "tool_choice": body.get("tool_choice", "auto"),
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "text": body.get("text") or {"format": {"type": "text"}},
        "metadata": body.get("metadata") or {},
        "previous_response_id": None,
        "store": False,
        "truncation": "disabled",
    }


def message_item(text: str, status: str = "completed", item_id: str | None = None) -> dict:
    content = [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else []
    return {
        "type": "message",
        "id": item_id or new_id("msg"),
        "status": status,
        "role": "assistant",
        "content": content,
    }


def call_item(call: dict, status: str = "completed", item_id: str | None = None) -> dict:
    return {
        "type": "function_call",
        "id": item_id or new_id("fc"),
        "call_id": call["id"],
        "name": call["function"]["name"],
        "arguments": call["function"]["arguments"] if status == "completed" else "",
        "status": status,
    }


def finish(response: dict, finish_reason: str | None, usage: dict | None) -> dict:
    """`response` ended: completed, or incomplete at max_output_tokens; with the chat usage as the
    Responses usage."""
    response["status"] = "incomplete" if finish_reason == "length" else "completed"
    if finish_reason == "length":
        response["incomplete_details"] = {"reason": "max_output_tokens"}
    if usage is not None:
        response["usage"] = {
            "input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"],
        }
    return response


def from_chat_answer(response: dict, chat: dict) -> dict:
    """The Response of a whole chat answer (one choice): its text as a message item, then its calls."""
    [choice] = chat["choices"]
    message = choice["message"]
    if message.get("content"):
        response["output"].append(message_item(message["content"]))
    for call in message.get("tool_calls") or ():
        response["output"].append(call_item(call))
    return finish(response, choice["finish_reason"], chat.get("usage"))
