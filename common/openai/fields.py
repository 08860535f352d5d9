"""Typed reads of an OpenAI request body's fields, and the error a client gets for a bad one.

Null means absent. Every check names the field it refuses (`param`), as OpenAI's API does.
"""

from __future__ import annotations

import math
from typing import Any, Callable

MASK64 = 2**64 - 1
# The wire's integer types (proto/pdserve.proto): a value past them cannot be sent on, so it is the
# client's 400 here rather than a protobuf ValueError (a 500) when the request is built.
INT32_MAX = 2**31 - 1
UINT32_MAX = 2**32 - 1
# Stop rules are checked against every generated token: bounded, so one request cannot make every
# step of a server (and the router's detokenizer) slow. vLLM has no bound; OpenAI allows 4 strings.
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024


class OpenAIError(Exception):
    """An error for the client, carried to the response in OpenAI's error format."""

    def __init__(self, message: str, status_code: int = 400, param: str | None = None, code: str | None = None):
        message, param = _encodable(message), None if param is None else _encodable(param)
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.param = param
        self.code = code
        # As OpenAI's API: its own failures (5xx) are "server_error"; the client's, 404
        # model_not_found and 401 included, "invalid_request_error".
        self.type = "server_error" if status_code >= 500 else "invalid_request_error"

    def to_body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _encodable(text: str) -> str:
    """`text` with lone surrogates (JSON lets a client send "\\ud800", e.g. as a field name an
    error names) written as escapes: an error body must encode as UTF-8, or it becomes a 500."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


# ---- typed field reads: null means absent --------------------------------------------------------


# bool before int: bool is a subclass of int
_JSON_TYPES = (
    (bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"), (list, "array"), (dict, "object")
)  # fmt: skip


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    return next((name for kind, name in _JSON_TYPES if isinstance(value, kind)), type(value).__name__)


def _wrong_type(name: str, expected: str, value: Any) -> OpenAIError:
    return OpenAIError(f"'{name}' must be {expected}, got {_json_type(value)}", param=name)


def _check(name: str, value: Any, ok: Callable[[Any], bool] | None, expect: str) -> Any:
    if ok is not None and not ok(value):
        raise OpenAIError(f"'{name}' must be {expect}, got {value!r}", param=name)
    return value


def _integer(body: dict, name: str, default: Any, ok: Callable[[int], bool] | None = None, expect: str = "") -> Any:
    value = body.get(name)
    if value is None:
        return default
    # bool is a subclass of int, and 1.0 is a float: both are rejected for integer fields
    if isinstance(value, bool) or not isinstance(value, int):
        raise _wrong_type(name, "an integer", value)
    return _check(name, value, ok, expect)


def _number(body: dict, name: str, default: Any, ok: Callable[[float], bool] | None = None, expect: str = "") -> Any:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _wrong_type(name, "a number", value)
    if not math.isfinite(value):  # json.loads accepts NaN and Infinity
        raise OpenAIError(f"'{name}' must be a finite number, got {value!r}", param=name)
    return _check(name, float(value), ok, expect)


def _boolean(body: dict, name: str, default: Any) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _wrong_type(name, "a boolean", value)
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _stop(body: dict) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise _wrong_type("stop", "a string or an array of strings", value)
    if not all(value):
        raise OpenAIError("'stop' strings must not be empty", param="stop")
    if len(value) > MAX_STOP_STRINGS or max(map(len, value), default=0) > MAX_STOP_STRING_CHARS:
        raise OpenAIError(
            f"'stop' takes at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_STRING_CHARS} characters each",
            param="stop",
        )
    for s in value:
        _check_unicode(s, "stop")
    return tuple(value)


def _stop_token_ids(body: dict, vocab_size: int) -> tuple[int, ...]:
    value = body.get("stop_token_ids")
    if value is None:
        return ()
    if not isinstance(value, list) or not all(_is_int(t) for t in value):
        raise _wrong_type("stop_token_ids", "an array of integers", value)
    if len(value) > MAX_STOP_TOKEN_IDS:
        raise OpenAIError(
            f"'stop_token_ids' takes at most {MAX_STOP_TOKEN_IDS} ids, got {len(value)}", param="stop_token_ids"
        )
    bad = [t for t in value if not 0 <= t < vocab_size]
    if bad:
        raise OpenAIError(
            f"'stop_token_ids' must be token ids in [0, {vocab_size}), got {bad[:5]}", param="stop_token_ids"
        )
    return tuple(value)


def _reject_unless_empty(body: dict, name: str, allowed: tuple = ()) -> None:
    """Fields we do not implement: accepted only when they ask for nothing."""
    value = body.get(name)
    if value is None or value in ({}, [], *allowed):
        return
    raise OpenAIError(f"'{name}' is not supported", param=name)


def _check_unicode(text: str, param: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # json.loads lets lone surrogates (\ud800) through; tokenizers and protobuf raise
        raise OpenAIError(f"'{param}' is not valid Unicode (it holds a lone surrogate)", param=param) from None


MAX_LOGIT_BIAS_TOKENS = 1024


def _logit_bias(body: dict, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias: {"token id": bias in [-100, 100]}, as sorted (id, bias) pairs."""
    value = body.get("logit_bias")
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise _wrong_type("logit_bias", "an object mapping token ids to numbers", value)
    if len(value) > MAX_LOGIT_BIAS_TOKENS:
        raise OpenAIError(
            f"'logit_bias' takes at most {MAX_LOGIT_BIAS_TOKENS} tokens, got {len(value)}", param="logit_bias"
        )
    pairs = []
    for key, bias in value.items():
        token = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() else None
        if token is None or not 0 <= token < vocab_size:
            raise OpenAIError(
                f"'logit_bias' keys must be token ids in [0, {vocab_size}), got {key!r}", param="logit_bias"
            )
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise OpenAIError(
                f"'logit_bias' values must be numbers in [-100, 100], got {bias!r} for token {token}",
                param="logit_bias",
            )
        pairs.append((token, float(bias)))
    return tuple(sorted(pairs))
