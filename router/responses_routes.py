"""POST /v1/responses: OpenAI's Responses API, served as the chat request it translates to
(common/openai/responses.py) by the chat endpoint's own flow (router/openai_routes.py `answer`: the
same validation, admission, router path and counting), its answer reshaped: the Response object, or
the chat stream's chunks turned into the Responses events (common/openai/response_events.py).

`router` is the app's Router (router/app.py); this module does not import it.
"""

from __future__ import annotations

import json

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from pdserve.common.openai.chat import parse_chat_request
from pdserve.common.openai.format import format_response
from pdserve.common.openai.response_events import ResponseEvents
from pdserve.common.openai.responses import chat_body, from_chat_answer, new_id, response_object
from pdserve.router.openai_routes import handle


def responses_routes(router) -> APIRouter:
    routes = APIRouter()

    @routes.post("/v1/responses")
    async def responses(request: Request):
        return await handle(router, request, parse_chat_request, ResponsesShape())

    return routes


class ResponsesShape:
    """One request's Responses body, kept for its answer (router/openai_routes.py `handle`'s `shape`)."""

    def __init__(self):
        self.body: dict = {}

    def request(self, body) -> dict:
        chat = chat_body(body)  # (OpenAIError: a 400 naming what is not served)
        self.body = body
        return chat

    def response(self, parsed, created: int) -> dict:
        return response_object(self.body, new_id("resp"), created, parsed.model)

    def stream(self, chunks, parsed, created: int):
        return events(chunks, ResponseEvents(self.response(parsed, created)))

    async def whole(self, router, parsed, completions, request_id: str, created: int) -> JSONResponse:
        chat = format_response(parsed, completions, router.tokenizer, request_id, created)
        return JSONResponse(from_chat_answer(self.response(parsed, created), chat))


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
