"""POST /v1/responses: OpenAI's Responses API, served as the chat request it translates to
(common/openai/responses.py): the same validation, admission, router path and answer, then the
Response object, or the chat stream's chunks turned into the Responses events
(common/openai/response_events.py). Counted in pdserve_router_requests_total as the OpenAI
endpoints are.

`router` is the app's Router (router/app.py); this module does not import it.
"""

from __future__ import annotations

import json
import secrets
import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from pdserve.common.openai.api import OpenAIError
from pdserve.common.openai.chat import parse_chat_request
from pdserve.common.openai.format import format_response
from pdserve.common.openai.response_events import ResponseEvents
from pdserve.common.openai.responses import chat_body, from_chat_answer, new_id, response_object
from pdserve.router.admission import Overloaded
from pdserve.router.http_answers import (
    AdmittedStream,
    ClientGone,
    error_response,
    overloaded_response,
    run_choices,
    until_disconnect,
    upstream_response,
)
from pdserve.router.http_requests import admit, body_of, parse_body
from pdserve.router.openai_routes import counted, log_request, stream
from pdserve.router.pairing import UpstreamError, fix_seed
from pdserve.router.timings import client_trace


def responses_routes(router) -> APIRouter:
    routes = APIRouter()

    @routes.post("/v1/responses")
    async def responses(request: Request):
        response = await answer(router, request)
        router.metrics.requests.labels(status=str(response.status_code)).inc()
        return response

    return routes


async def answer(router, request: Request):
    started = time.monotonic()
    try:
        body, size = await body_of(router, request)
        parsed = await parse_body(router, parse_chat_request, chat_body(body), size)
    except OpenAIError as e:
        return error_response(e)
    if not router.serving():
        return error_response(OpenAIError(router.unserved(), status_code=503))
    choices = [(ids, fix_seed(p)) for ids, p in parsed.engine_requests()]  # (one: a Response has no `n`)
    try:
        lanes = await admit(router, request, len(choices))
    except Overloaded as e:
        return overloaded_response(e)
    except ClientGone:
        return JSONResponse({}, status_code=499)
    request_id, created, trace = secrets.token_hex(12), int(time.time()), client_trace(request.headers)
    response = response_object(body, new_id("resp"), created, parsed.model)
    if parsed.stream:
        chunks = counted(router, stream(router, parsed, choices, lanes, request_id, created, started, trace))
        return AdmittedStream(
            events(chunks, ResponseEvents(response)),
            lambda: router.admission.release(lanes),
            media_type="text/event-stream",
            send_timeout=router.config.stream_send_timeout,
        )
    router.inflight += 1
    try:
        completions = await until_disconnect(
            request, run_choices(choices, lanes, lambda i, ids, p: router.choice(ids, p, arrived=started, trace=trace))
        )
    except UpstreamError as e:
        log_request(request_id, parsed, e.status, None, started)
        return upstream_response(e)
    except ClientGone:
        log_request(request_id, parsed, 499, None, started)
        return JSONResponse({}, status_code=499)
    finally:
        router.inflight -= 1
        router.admission.release(lanes)
    log_request(request_id, parsed, 200, completions, started)
    chat = format_response(parsed, completions, router.tokenizer, request_id, created)
    return JSONResponse(from_chat_answer(response, chat))


async def events(chunks, translate: ResponseEvents):
    """The chat stream's SSE text (`data: {chunk}` blocks, `data: [DONE]` last) as Responses events."""
    yield "".join(translate.start())
    try:
        async for text in chunks:
            out = []
            for block in text.split("\n\n"):
                if block.startswith("data: ") and block != "data: [DONE]":
                    out += translate.chunk(json.loads(block.removeprefix("data: ")))
            if out:
                yield "".join(out)
            if translate.response["status"] == "failed":
                return  # (the error and response.failed are out; `chunks` cancels the choice)
        yield "".join(translate.end())
    finally:
        await chunks.aclose()
