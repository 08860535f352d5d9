"""How the router reads a request over HTTP, before it answers it: the API key, the JSON body, the
body validated as OpenAI's (common/openai/api.py, the same rules as run-batch), and the wait for
the request's turn (router/admission.py). Shared by the OpenAI and the native endpoints
(router/openai_routes.py, router/native_routes.py); each failure is an OpenAIError, answered as
OpenAI's error body.

No request may hold the worker's event loop (every other request, stream and health check of the
process waits on it): a body is read up to the router's byte limit and refused past it (413), a
text that cannot fit the model's context is refused before it is tokenized (400), a large body is
parsed in the worker's parser process (router/body_parser.py), and templated and tokenized on a thread.
"""

from __future__ import annotations

import asyncio
import json

from fastapi import Request
from starlette.requests import ClientDisconnect

from pdserve.common.openai.api import OpenAIError, ParsedRequest
from pdserve.router.http_answers import until_disconnect

# Bodies of this size and more are parsed, templated and tokenized on the router's thread for heavy
# work (router/app.py), off the event loop: tokenizing 8 KiB of text takes ~3 ms (SmolLM2's tokenizer,
# 2-core host), the hop to the thread ~0.1 ms.
# NOTE: that thread frees the loop while the tokenizer (Rust, GIL released) and the template (Python)
# run, but json.loads holds the GIL: a body of 16 MiB of token ids would hold the loop ~130 ms even
# there. So bodies of PROCESS_BYTES and more are parsed in the worker's parser process
# (router/body_parser.py); below it json.loads takes at most ~10 ms (dict-heavy bodies, this box).
OFF_LOOP_BYTES = 8 * 1024
PROCESS_BYTES = 128 * 1024


async def body_of(router, request: Request) -> tuple[dict, int]:
    """The request's JSON object and its size in bytes, once its API key (when the router has one)
    is right."""
    if router.config.api_key and request.headers.get("authorization") != f"Bearer {router.config.api_key}":
        raise OpenAIError("invalid or missing API key (Authorization: Bearer ...)", status_code=401)
    raw = await read_limited(request, router.max_body_bytes)
    if len(raw) >= PROCESS_BYTES:
        body = await router.body_parser.loads(raw, router.context_len)
        if not isinstance(body, dict):
            raise OpenAIError("the request body must be a JSON object")
        return body, len(raw)
    try:
        body = json.loads(raw) if len(raw) < OFF_LOOP_BYTES else await off_loop(router, json.loads, raw)
    except ValueError as e:
        raise OpenAIError(f"the request body is not valid JSON: {e}") from e
    except RecursionError:
        raise OpenAIError("the request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise OpenAIError("the request body must be a JSON object")
    return body, len(raw)


async def read_limited(request: Request, limit: int) -> bytes:
    """The body, or 413 once it is known to pass `limit` bytes: from its Content-Length before any
    of it is read, else as it arrives (chunked); 499 when the client goes away before all of it came."""
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise _too_large(int(length), limit)
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(size, limit)
            chunks.append(chunk)
    except ClientDisconnect:  # answered as the routes answer a client gone while it waits: 499, to nobody
        raise OpenAIError("the client went away before its whole body came", status_code=499) from None
    return b"".join(chunks)


def _too_large(size: int, limit: int) -> OpenAIError:
    return OpenAIError(
        f"the request body is larger than this router takes ({size} > {limit} bytes: --max-body-bytes)",
        status_code=413,
    )


async def parse_body(router, parse, body: dict, body_bytes: int = 0) -> ParsedRequest:
    """`body` validated and tokenized by `parse` (a completion or a chat request) for this model; on
    a thread when the body was large (`body_bytes`). A text too long for the context is refused first."""
    check_text_fits(router, body)
    if body_bytes >= OFF_LOOP_BYTES:
        return await off_loop(router, _parse, router, parse, body)
    return _parse(router, parse, body)


async def off_loop(router, fn, *args):
    """fn(*args), run on the router's thread for heavy work (router/app.py)."""
    return await asyncio.get_running_loop().run_in_executor(router.off_loop, fn, *args)


def check_text_fits(router, body: dict) -> None:
    """400 for a prompt whose text could not fit the context even at the tokenizer's longest token
    per token (with a factor 2 for normalizers that drop characters), before anything tokenizes it."""
    limit = 2 * router.context_len * router.longest_token_chars
    for chars in _prompt_chars(body):
        if chars > limit:
            raise OpenAIError(
                f"the prompt has {chars} characters: more than {router.context_len} tokens of this model "
                f"can hold (its tokens are at most {router.longest_token_chars} characters)"
            )


def _prompt_chars(body: dict) -> list[int]:
    """The characters of each text prompt in an OpenAI body (a completion's prompts, or a chat's
    messages together); non-text parts are the parsers' to check."""
    prompt = body.get("prompt")
    sizes = [len(prompt)] if isinstance(prompt, str) else []
    if isinstance(prompt, list):
        sizes += [len(p) for p in prompt if isinstance(p, str)]
    messages = body.get("messages")
    if isinstance(messages, list):
        total = 0
        for message in messages:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, str):
                total += len(content)
            elif isinstance(content, list):
                total += sum(len(p["text"]) for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
        sizes.append(total)
    return sizes


def _parse(router, parse, body: dict) -> ParsedRequest:
    return parse(
        body,
        router.tokenizer,
        router.model,
        router.context_len,
        allow_stream=True,
        max_choices=router.config.max_choices,
        vocab_size=router.vocab_size,
        defaults=router.defaults,
        aliases=router.aliases,
    )


async def admit(router, request: Request, choices: int) -> int:
    """Wait for the request's turn (its slots); Overloaded or ClientGone when it does not come."""
    return await until_disconnect(request, router.admission.acquire(min(choices, router.config.max_choices_at_once)))
