"""The OpenAI Batch file driver: JSONL requests in, one JSONL result per request out, in order.

Every line is validated first; all valid requests then go to the engine in ONE generate call, so
continuous batching runs them together. A bad line gets its own error response (400, or 404 for an
unknown model) and never stops the others. An engine failure is a server bug, not a line's fault:
it propagates and no output is written.
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass
from typing import Any

from pdserve.common.openai.api import OpenAIError, ParsedRequest, parse_completion_request
from pdserve.common.openai.chat import parse_chat_request
from pdserve.common.openai.format import format_response

PARSERS = {"/v1/completions": parse_completion_request, "/v1/chat/completions": parse_chat_request}
LINE_FIELDS = {"custom_id", "method", "url", "body"}


@dataclass
class _Line:
    """One input line: either a parsed request (and where its choices sit in the generate call) or an error."""

    custom_id: Any
    parsed: ParsedRequest | None = None
    error: OpenAIError | None = None
    first: int = 0  # index of this line's first choice in the generate call


def _parse_line(raw: bytes, line_number: int, seen_ids: set, engine, served_model_name: str, defaults) -> _Line:
    try:
        request = json.loads(raw)
    except ValueError as e:  # JSONDecodeError, or UnicodeDecodeError for bytes that are not UTF-8
        return _Line(None, error=OpenAIError(f"line {line_number} is not valid JSON: {e}"))
    if not isinstance(request, dict):
        return _Line(None, error=OpenAIError(f"line {line_number} must be a JSON object"))
    line = _Line(request.get("custom_id"))
    try:
        _check_envelope(request, seen_ids)
        parse = PARSERS[request["url"]]
        line.parsed = parse(
            request["body"],
            engine.tokenizer,
            served_model_name,
            engine.max_context_len,
            defaults=defaults,
            aliases=_aliases(engine),
        )
        check = getattr(engine, "check_request", None)
        for prompt_ids, params in line.parsed.engine_requests() if check else ():
            check(prompt_ids, params)
    except OpenAIError as e:
        line.error = e
    except ValueError as e:  # the engine's own limits (KV pool size, model vocabulary)
        line.parsed, line.error = None, OpenAIError(str(e))
    return line


def _check_envelope(request: dict, seen_ids: set) -> None:
    """custom_id, method and url; a custom_id is taken by its first line, valid or not."""
    custom_id = request.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise OpenAIError("'custom_id' is required and must be a non-empty string", param="custom_id")
    if custom_id in seen_ids:
        raise OpenAIError(f"duplicate custom_id {custom_id!r}: each line needs its own", param="custom_id")
    seen_ids.add(custom_id)
    unknown = sorted(set(request) - LINE_FIELDS)
    if unknown:
        raise OpenAIError(f"unknown field(s) in the batch line: {', '.join(unknown)}")
    if request.get("method") != "POST":
        raise OpenAIError(f"'method' must be \"POST\", got {request.get('method')!r}", param="method")
    if not isinstance(request.get("url"), str) or request["url"] not in PARSERS:
        raise OpenAIError(f"'url' must be one of {', '.join(PARSERS)}, got {request.get('url')!r}", param="url")
    if "body" not in request:
        raise OpenAIError("'body' is required", param="body")


def _result(line: _Line, completions: list, tokenizer, created: int) -> dict:
    request_id = secrets.token_hex(16)
    if line.error is not None:
        response = {"status_code": line.error.status_code, "request_id": request_id, "body": line.error.to_body()}
    else:
        mine = completions[line.first : line.first + len(line.parsed.params)]
        body = format_response(line.parsed, mine, tokenizer, request_id, created)
        response = {"status_code": 200, "request_id": request_id, "body": body}
    batch_request_id = f"batch_req_{secrets.token_hex(16)}"
    return {"id": batch_request_id, "custom_id": line.custom_id, "response": response, "error": None}


def _aliases(engine) -> tuple[str, ...]:
    """--model-path as given names the model too (beside its served name)."""
    config = getattr(engine, "config", None)
    return (config.model_path,) if config is not None else ()


def run_batch(engine, input_path, output_path, served_model_name: str, defaults=None) -> dict:
    """Run an OpenAI Batch input file through `engine`; returns {"total", "succeeded", "failed"}.
    `defaults`: what sampling fields a line leaves out take (common/openai/defaults.py; None: OpenAI's).

    `engine` needs `.tokenizer`, `.max_context_len` and `.generate(prompts, params)`; when it has
    `.check_request(prompt_ids, params)` (raising ValueError), each line is checked against the
    engine's own limits up front, so one oversized line cannot fail the whole generate call.
    """
    lines: list[_Line] = []
    seen_ids: set[str] = set()
    with open(input_path, "rb") as f:  # bytes: one line that is not UTF-8 must not sink the others
        for line_number, raw in enumerate(f, start=1):
            if raw.strip():
                lines.append(_parse_line(raw, line_number, seen_ids, engine, served_model_name, defaults))

    prompts, params = [], []
    for line in lines:
        if line.parsed is not None:
            line.first = len(prompts)
            for prompt_ids, choice_params in line.parsed.engine_requests():
                prompts.append(prompt_ids)
                params.append(choice_params)
    completions = engine.generate(prompts, params) if prompts else []
    created = int(time.time())

    with open(output_path, "w", encoding="utf-8") as f:
        for line in lines:
            f.write(json.dumps(_result(line, completions, engine.tokenizer, created), ensure_ascii=False) + "\n")
    failed = sum(line.error is not None for line in lines)
    return {"total": len(lines), "succeeded": len(lines) - failed, "failed": failed}
