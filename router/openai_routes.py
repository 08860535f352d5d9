"""The OpenAI-compatible endpoints: POST /v1/completions and /v1/chat/completions.

Validate and tokenize the body (router/http_requests.py), wait for a turn (admission), run every
choice through a prefill/decode pair (the Router's `choice`), and answer in OpenAI's shapes:
common/openai/format.py for a whole answer (written on a thread when large: router/large_answers.py);
OpenAI's SSE chunks (router/stream_chunks.py), `stream_options.include_usage` and `data: [DONE]` for a
streamed one. Every error a client sees is
OpenAI's error body: 400/404 for the body, 429 (with Retry-After) when the router's queue is full
or a request's turn does not come in time (router/admission.py), 5xx only for the servers' failures.

`router` is the app's Router (router/app.py); this module does not import it, since app.py imports
this one.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from pdserve.common.openai.api import OpenAIError, ParsedRequest, parse_completion_request
from pdserve.common.openai.chat import parse_chat_request
from pdserve.router.admission import Overloaded
from pdserve.router.http_answers import (
    AdmittedStream,
    ClientGone,
    error_response,
    overloaded_response,
    queued_batches,
    run_choices,
    until_disconnect,
    upstream_response,
)
from pdserve.router.http_requests import admit, body_of, parse_body
from pdserve.router.large_answers import whole_answer
from pdserve.router.pairing import UpstreamError, fix_seed
from pdserve.router.stream_chunks import StreamChunks
from pdserve.router.timings import client_trace, describe

log = logging.getLogger(__name__)


def openai_routes(router) -> APIRouter:
    """POST /v1/completions and /v1/chat/completions, served by `router`."""
    routes = APIRouter()

    @routes.post("/v1/completions")
    async def completions(request: Request):
        return await handle(router, request, parse_completion_request)

    @routes.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(router, request, parse_chat_request)

    return routes


async def handle(router, request: Request, parse, shape=None):
    """The answer, its status counted (pdserve_router_requests_total). `shape`: another API served as the
    chat request it translates to (router/responses_routes.py ResponsesShape): its `request(body)` gives
    the chat body, `stream(chunks, parsed, created)` and `whole(router, parsed, completions, request_id,
    created)` its answer."""
    response = await answer(router, request, parse, shape)
    router.metrics.requests.labels(status=str(response.status_code)).inc()
    return response


def log_request(request_id: str, parsed: ParsedRequest, status: int, completions, started: float) -> None:
    """The request's one line at info level (vLLM's "Finished request" line): what it asked, what it got,
    and where the time of its slowest choice went (router/timings.py)."""
    if not log.isEnabledFor(logging.INFO):
        return
    done = [c for c in completions or () if c is not None]
    timed = [c.timings for c in done if c.timings is not None]
    slowest = max(timed, key=lambda t: t["total_s"], default=None)
    log.info(
        "request %s: %s, %d prompt tokens x %d choices -> %d; %d completion tokens, finish %s, %.3f s%s",
        request_id,
        parsed.kind + (" (streamed)" if parsed.stream else ""),
        sum(map(len, parsed.prompts)),
        len(parsed.params),
        status,
        sum(len(c.output_ids) for c in done),
        ",".join(sorted({c.finish_reason.value for c in done})) or "-",
        time.monotonic() - started,
        "" if slowest is None else f"; {'slowest choice: ' if len(done) > 1 else ''}{describe(slowest)}",
    )


async def answer(router, request: Request, parse, shape=None):
    """Checks in this order: the key and body, validation, a server to serve it, admission."""
    started = time.monotonic()
    try:
        body, size = await body_of(router, request)
        parsed = await parse_body(router, parse, body if shape is None else shape.request(body), size)
    except OpenAIError as e:
        log.info("request refused: %d %s", e.status_code, e)
        return error_response(e)
    if not router.serving():
        return error_response(OpenAIError(router.unserved(), status_code=503))
    choices = [(ids, fix_seed(p)) for ids, p in parsed.engine_requests()]
    try:
        lanes = await admit(router, request, len(choices))
    except Overloaded as e:
        return overloaded_response(e)
    except ClientGone:
        return JSONResponse({}, status_code=499)
    request_id, created, trace = secrets.token_hex(12), int(time.time()), client_trace(request.headers)
    if parsed.stream:
        chunks = counted(router, stream(router, parsed, choices, lanes, request_id, created, started, trace))
        return AdmittedStream(
            chunks if shape is None else shape.stream(chunks, parsed, created),
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
    return await (whole_answer if shape is None else shape.whole)(router, parsed, completions, request_id, created)


async def counted(router, chunks):
    """A streamed request is in flight until its last chunk is sent, not until it is admitted."""
    router.inflight += 1
    try:
        async for chunk in chunks:
            yield chunk
    finally:
        router.inflight -= 1
        await chunks.aclose()  # (closed mid-answer: `chunks`' own finally cancels the choices)


async def stream(
    router, parsed: ParsedRequest, choices, lanes: int, request_id: str, created: int, started: float, trace: dict
):
    """The SSE body of a streamed request: every choice's chunks as they come, usage, [DONE]. `started`: the
    request's arrival; `trace`: its client's trace headers (router/timings.py)."""
    chunks = StreamChunks(parsed, router.tokenizer, request_id, created)
    queue: asyncio.Queue = asyncio.Queue()

    async def run(index: int, ids, params):
        async def on_text(delta: str, logprobs):
            for chunk in chunks.text(index, delta, logprobs):  # none while a tool call is held back
                await queue.put(chunk)

        async def on_prompt(prompt_logprobs):
            """Echo: the prompt leads the choice's stream, with its logprobs when asked."""
            if parsed.echo:
                await queue.put(await chunks.echo(index, ids, prompt_logprobs, router.off_loop))

        try:
            completion = await router.choice(ids, params, on_text, on_prompt, arrived=started, trace=trace)
            timings = completion.timings if parsed.return_timings else None
            for chunk in chunks.finish(index, completion.finish_reason.value, timings):
                await queue.put(chunk)
            return completion
        except UpstreamError as e:
            await queue.put(json.dumps(OpenAIError(str(e), status_code=e.status).to_body()))
            return None

    if chunks.chat:
        for i in range(len(choices)):
            yield f"data: {chunks.choice(i, None, None, role=True)}\n\n"
    # One task runs every choice, `lanes` at a time (run() answers a failed choice in the stream).
    tasks = [asyncio.create_task(run_choices(choices, lanes, run))]
    completions = None
    try:
        async for items in queued_batches(queue, tasks):
            yield "".join(f"data: {item}\n\n" for item in items)
        [completions] = [task.result() for task in tasks]
        if parsed.include_usage and all(c is not None for c in completions):
            yield f"data: {chunks.usage(completions)}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        # 200 was sent with the first chunk; a client gone mid-answer shows as fewer tokens, finish "-"
        log_request(request_id, parsed, 200, completions, started)
        for task in tasks:  # the client went away: cancel both sides of every choice
            task.cancel()
