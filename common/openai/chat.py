"""Chat completion requests: messages and their content, validated into a ParsedRequest with the
chat template applied (the shared field rules are in api.py)."""

from __future__ import annotations

from typing import Any

# The field rules both endpoints share (package-internal: api.py and this module are one parser).
from pdserve.common.openai.api import (
    CHAT_FIELDS, CHAT_ROLES, ParsedRequest, _build, _max_tokens, _shared, _tokenize, check_fan_out,
)
from pdserve.common.openai.fields import OpenAIError, _boolean, _integer, _json_type, _reject_unless_empty, _wrong_type
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
            raise _message_error(index, ".content' parts must be {\"type\": \"text\", \"text\": ...} (only text)")
        if not isinstance(part["text"], str):
            raise _message_error(index, f".content' part text must be a string, got {_json_type(part['text'])}")
    return "".join(part["text"] for part in content)


def _chat_messages(messages: Any) -> list[dict]:
    """The conversation as the chat template sees it: {role, content: str[, name]}."""
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
        unknown = sorted(set(message) - {"role", "content", "name"})
        if unknown:
            raise _message_error(i, f"' has unsupported field(s): {', '.join(unknown)}")
        role = message.get("role")
        if not isinstance(role, str) or role not in CHAT_ROLES:  # (a dict or a list is not hashable)
            raise _message_error(i, f".role' must be one of {', '.join(CHAT_ROLES)}, got {role!r}")
        if message.get("content") is None:
            raise _message_error(i, ".content' is required")
        entry = {"role": CHAT_ROLES[role], "content": _message_content(message["content"], i)}
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


def parse_chat_request(
    body: dict, tokenizer, served_model_name: str, max_context_len: int, *, allow_stream: bool = False,
    max_choices: int | None = None, vocab_size: int | None = None,
) -> ParsedRequest:  # fmt: skip
    """Validate a /v1/chat/completions body and render its conversation. Raises OpenAIError.

    `max_choices` and `vocab_size` as in parse_completion_request."""
    vocab_size = len(tokenizer) if vocab_size is None else vocab_size
    shared = _shared(body, served_model_name, CHAT_FIELDS, allow_stream, vocab_size)
    check_fan_out(1, shared["n"], max_choices, "n")
    response_format = body.get("response_format")
    if response_format is not None and response_format != {"type": "text"}:
        raise OpenAIError("'response_format' is not supported (only {\"type\": \"text\"})", param="response_format")
    for name in ("tools", "functions"):
        _reject_unless_empty(body, name)
    for name in ("tool_choice", "function_call"):
        _reject_unless_empty(body, name, allowed=("none",))
    logprobs = _chat_logprobs(body)
    max_tokens = _chat_max_tokens(body)
    messages = _chat_messages(body.get("messages"))
    if not getattr(tokenizer, "chat_template", None):
        raise OpenAIError("this model has no chat template; use /v1/completions")
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as e:  # templates raise (jinja's raise_exception) on conversations they refuse
        raise OpenAIError(f"the chat template rejected the messages: {e}", param="messages") from None
    # The template already carries BOS; adding special tokens again would double it.
    prompt = _tokenize(tokenizer, text, False, "messages")
    return _build(
        "chat", shared, served_model_name, [prompt], [text], max_tokens, logprobs, max_context_len, messages=messages
    )
