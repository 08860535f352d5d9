"""The native endpoint: POST /generate, one prompt (text or token ids) with OpenAI's completion
fields as its sampling parameters, answered with text and token ids (whole, or SSE deltas).

The body becomes an OpenAI completion body and is validated by the same rules
(router/http_requests.py). Unlike the OpenAI endpoints it is not counted in
pdserve_router_requests_total and does not check for a healthy server before admission.

`router` is the app's Router (router/app.py); this module does not import it, since app.py imports
this one.
"""

from __future__ import annotations

import asyncio
import json
import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from pdserve.common.openai.api import OpenAIError, parse_completion_request
from pdserve.router.admission import Overloaded
from pdserve.router.http_answers import (
    AdmittedStream,
    ClientGone,
    error_response,
    overloaded_response,
    queued_batches,
    upstream_response,
)
from pdserve.router.http_requests import admit, body_of, parse_body
from pdserve.router.pairing import UpstreamError, fix_seed
from pdserve.router.timings import client_trace


def native_routes(router) -> APIRouter:
    """POST /generate, served by `router`."""
    routes = APIRouter()

    @routes.post("/generate")
    async def generate(request: Request):
        """Native: {"text" | "input_ids", "sampling_params": {OpenAI completion fields}, "stream",
        "return_timings"} -> {"text", "output_ids", "finish_reason", "usage"} (or SSE of {"text"} deltas,
        then one {"output_ids", "finish_reason", "usage"}), and "timings" when asked for (router/timings.py)."""
        arrived = time.monotonic()
        try:
            body, size = await body_of(router, request)
            parsed = await parse_body(router, parse_completion_request, completion_body(body), size)
        except OpenAIError as e:
            return error_response(e)
        if parsed.n != 1 or len(parsed.prompts) != 1:
            return error_response(OpenAIError("/generate takes one prompt and n = 1"))
        [(ids, params)] = [(i, fix_seed(p)) for i, p in parsed.engine_requests()]
        try:
            lanes = await admit(router, request, 1)
        except Overloaded as e:
            return overloaded_response(e)
        except ClientGone:
            return JSONResponse({}, status_code=499)
        if parsed.stream:
            return AdmittedStream(
                native_stream(router, ids, params, (arrived, client_trace(request.headers)), parsed.return_timings),
                lambda: router.admission.release(lanes),
                media_type="text/event-stream",
                send_timeout=router.config.stream_send_timeout,
            )
        try:
            c = await router.choice(ids, params, arrived=arrived, trace=client_trace(request.headers))
        except UpstreamError as e:
            return upstream_response(e)
        finally:
            router.admission.release(lanes)
        # A dict, not a JSONResponse: FastAPI serializes it, as it always has for this endpoint.
        return {
            "text": c.text,
            "output_ids": c.output_ids,
            "finish_reason": c.finish_reason.value,
            "usage": usage_of(ids, c),
        } | timings_of(c, parsed.return_timings)

    return routes


def usage_of(ids: list[int], c) -> dict:
    """/generate's usage: OpenAI's counts, the prompt tokens a prefix cache held, and the KV bytes the
    prefill server wrote to the decode server (0 for a prompt the decode server prefilled itself)."""
    return {
        "prompt_tokens": len(ids),
        "completion_tokens": len(c.output_ids),
        "cached_tokens": c.cached_tokens,
        "kv_transfer_bytes": c.kv_transfer_bytes,
    }


def timings_of(c, asked: bool) -> dict:
    """The answer's "timings", when the request asked for them ("return_timings": true)."""
    return {"timings": c.timings} if asked and c.timings is not None else {}


def completion_body(body: dict) -> dict:
    """The OpenAI completion body a native one stands for (its prompt, stream and sampling fields)."""
    if ("text" in body) == ("input_ids" in body):
        raise OpenAIError("give exactly one of 'text' or 'input_ids'")
    sampling = body.get("sampling_params") or {}
    if not isinstance(sampling, dict):
        raise OpenAIError("'sampling_params' must be an object")
    native = {"prompt": body.get("text", body.get("input_ids")), "stream": bool(body.get("stream"))}
    if "return_timings" in body:  # (validated with the rest: a boolean)
        native["return_timings"] = body["return_timings"]
    return {**sampling, **native}


async def native_stream(router, ids: list[int], params, started: tuple[float, dict], return_timings: bool):
    """The SSE body of a streamed /generate: {"text"} deltas, then the output ids and finish reason (and
    the timings, when asked for). `started`: the request's arrival and its client's trace headers."""
    arrived, trace = started
    queue: asyncio.Queue = asyncio.Queue()

    async def on_text(delta, logprobs):
        if delta:
            await queue.put({"text": delta})

    task = asyncio.create_task(router.choice(ids, params, on_text, arrived=arrived, trace=trace))
    try:
        async for items in queued_batches(queue, [task]):
            yield "".join(f"data: {json.dumps(item)}\n\n" for item in items)
        c = task.result()
        last = {"output_ids": c.output_ids, "finish_reason": c.finish_reason.value, "usage": usage_of(ids, c)}
        last |= timings_of(c, return_timings)
        yield "data: " + json.dumps(last) + "\n\n"
        yield "data: [DONE]\n\n"
    finally:
        task.cancel()
