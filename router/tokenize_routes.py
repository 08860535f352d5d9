"""POST /tokenize and /detokenize (common/openai/tokenize.py: vLLM's shapes): the router's own
tokenizer and chat template answer them, no server is asked. Bodies are read and bounded as every
other endpoint's (router/http_requests.py); a large one is tokenized off the event loop.

`router` is the app's Router (router/app.py); this module does not import it.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from pdserve.common.openai.api import OpenAIError
from pdserve.common.openai.tokenize import detokenize, tokenize
from pdserve.router.http_answers import error_response
from pdserve.router.http_requests import OFF_LOOP_BYTES, body_of, check_text_fits, off_loop


def tokenize_routes(router) -> APIRouter:
    routes = APIRouter()

    async def answer(request: Request, fn, *args) -> JSONResponse:
        try:
            body, size = await body_of(router, request)
            check_text_fits(router, body)
            if size >= OFF_LOOP_BYTES:
                return JSONResponse(await off_loop(router, fn, body, router.tokenizer, router.model, *args))
            return JSONResponse(fn(body, router.tokenizer, router.model, *args))
        except OpenAIError as e:
            return error_response(e)

    @routes.post("/tokenize")
    async def tokenize_route(request: Request):
        """{"prompt" | "messages", ...} -> {"count", "max_model_len", "tokens", "token_strs"}."""
        return await answer(request, tokenize, router.context_len, router.aliases)

    @routes.post("/detokenize")
    async def detokenize_route(request: Request):
        """{"tokens": [...]} -> {"prompt": text}."""
        return await answer(request, detokenize, router.vocab_size, router.aliases)

    return routes
