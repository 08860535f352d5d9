"""POST /tokenize and /detokenize, in vLLM's shapes: what a prompt or a conversation costs in tokens
(exactly the ids the completion or chat endpoint would prefill), and the text of token ids.

    /tokenize    {"prompt": str, "add_special_tokens": true}                    a completion's prompt
                 {"messages": [...], "tools": [...], "add_generation_prompt": true,
                  "continue_final_message": false, "add_special_tokens": false}  a chat's conversation
                 -> {"count", "max_model_len", "tokens", "token_strs" (with "return_token_strs": true)}
    /detokenize  {"tokens": [int, ...]} -> {"prompt": str}

The defaults are the endpoints': a completion's prompt gets the tokenizer's special tokens (BOS), a
conversation's template carries its own. Both take an optional "model" (checked as the other
endpoints check it). Errors are OpenAIError (400, or 404 for another model).
"""

from __future__ import annotations

from pdserve.common.openai.api import _check_fields, _check_model, _tokenize
from pdserve.common.openai.chat import _chat_messages, _render
from pdserve.common.openai.fields import OpenAIError, _boolean, _is_int, _json_type, _wrong_type
from pdserve.common.openai.tools import parse_tools

TOKENIZE_FIELDS = frozenset(
    {
        "model",
        "prompt",
        "messages",
        "tools",
        "add_special_tokens",
        "add_generation_prompt",
        "continue_final_message",
        "return_token_strs",
    }
)
DETOKENIZE_FIELDS = frozenset({"model", "tokens"})


def tokenize(body: dict, tokenizer, served_model_name: str, max_model_len: int, aliases: tuple[str, ...] = ()) -> dict:
    """The /tokenize answer for `body`."""
    _check_fields(body, TOKENIZE_FIELDS)
    _check_model(body, served_model_name, aliases)
    if ("prompt" in body) == ("messages" in body):
        raise OpenAIError("give either 'prompt' (a text) or 'messages' (a conversation)", param="prompt")
    if "prompt" in body:
        if not isinstance(body["prompt"], str):
            raise _wrong_type("prompt", "a string", body["prompt"])
        for name in ("tools", "add_generation_prompt", "continue_final_message"):
            if name in body:
                raise OpenAIError(f"'{name}' is for 'messages', not 'prompt'", param=name)
        ids = _tokenize(tokenizer, body["prompt"], _boolean(body, "add_special_tokens", True), "prompt")
    else:
        ids = _conversation_ids(body, tokenizer)
    strs = tokenizer.convert_ids_to_tokens(ids) if _boolean(body, "return_token_strs", False) else None
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs}


def _conversation_ids(body: dict, tokenizer) -> list[int]:
    messages = _chat_messages(body["messages"])
    generation_prompt = _boolean(body, "add_generation_prompt", True)
    continue_final = _boolean(body, "continue_final_message", False)
    if generation_prompt and continue_final:
        raise OpenAIError(
            "'add_generation_prompt' and 'continue_final_message' cannot both be true: the first opens a new "
            "assistant message, the second continues the last one",
            param="continue_final_message",
        )
    if not getattr(tokenizer, "chat_template", None):
        raise OpenAIError("this model has no chat template; tokenize a 'prompt'", param="messages")
    prompt = {"add_generation_prompt": generation_prompt, "continue_final_message": continue_final}
    text = _render(tokenizer, messages, parse_tools(body), **prompt)
    return _tokenize(tokenizer, text, _boolean(body, "add_special_tokens", False), "messages")


def detokenize(body: dict, tokenizer, served_model_name: str, vocab_size: int, aliases: tuple[str, ...] = ()) -> dict:
    """The /detokenize answer for `body`: the ids' text, special tokens included."""
    _check_fields(body, DETOKENIZE_FIELDS)
    _check_model(body, served_model_name, aliases)
    tokens = body.get("tokens")
    if not isinstance(tokens, list):
        raise _wrong_type("tokens", "an array of token ids", tokens)
    for i, token in enumerate(tokens):
        if not _is_int(token) or not 0 <= token < vocab_size:
            shown = token if _is_int(token) else _json_type(token)
            raise OpenAIError(f"'tokens[{i}]' must be a token id in [0, {vocab_size}), got {shown}", param="tokens")
    return {"prompt": tokenizer.decode(tokens)}
