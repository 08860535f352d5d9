"""How the router reads a request over HTTP, before it answers it: the API key, the JSON body, the
body validated as OpenAI's (common/openai/api.py, the same rules as run-batch), and the wait for
the request's turn (router/admission.py). Shared by the OpenAI and the native endpoints
(router/openai_routes.py, router/native_routes.py); each failure is an OpenAIError, answered as
OpenAI's error body.
"""

from __future__ import annotations

import json

from fastapi import Request

from pdserve.common.openai.api import OpenAIError, ParsedRequest
from pdserve.router.http_answers import until_disconnect


async def body_of(router, request: Request) -> dict:
    """The request's JSON object, once its API key (when the router has one) is right."""
    if router.config.api_key and request.headers.get("authorization") != f"Bearer {router.config.api_key}":
        raise OpenAIError("invalid or missing API key (Authorization: Bearer ...)", status_code=401)
    try:
        body = json.loads(await request.body())
    except ValueError as e:
        raise OpenAIError(f"the request body is not valid JSON: {e}") from e
    except RecursionError:
        raise OpenAIError("the request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise OpenAIError("the request body must be a JSON object")
    return body


def parse_body(router, parse, body: dict) -> ParsedRequest:
    """`body` validated and tokenized by `parse` (a completion or a chat request) for this model."""
    return parse(
        body,
        router.tokenizer,
        router.model,
        router.context_len,
        allow_stream=True,
        max_choices=router.config.max_choices,
        vocab_size=router.vocab_size,
    )


async def admit(router, request: Request, choices: int) -> int:
    """Wait for the request's turn (its slots); Overloaded or ClientGone when it does not come."""
    return await until_disconnect(request, router.admission.acquire(min(choices, router.config.max_choices_at_once)))
