"""The router's HTTP API (OpenAI-compatible): validate, tokenize, pair a prefill and a decode
worker per choice, stream or collect the tokens, answer in OpenAI's shapes.

Bodies are validated by common/openai_api.py (the same rules as run-batch) and answered by
common/openai_format.py; streaming follows OpenAI's SSE chunks, `stream_options.include_usage`
and `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from dataclasses import dataclass

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.common.config import read_hf_config
from pdserve.common.detokenizer import IncrementalDetokenizer
from pdserve.common.openai_api import OpenAIError, ParsedRequest, parse_chat_request, parse_completion_request
from pdserve.common.openai_format import format_response, usage
from pdserve.common.output_processor import append_token, finalize
from pdserve.common.tokenizer import eos_token_ids, load_tokenizer
from pdserve.common.types import Completion, FinishReason, Req
from pdserve.router.pairing import UpstreamError, fix_seed, paired_generate
from pdserve.router.policies import WorkerView, make_policy


@dataclass(frozen=True)
class RouterConfig:
    model_path: str
    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    served_model_name: str = ""
    api_key: str = ""
    prefill_policy: str = "round_robin"
    decode_policy: str = "round_robin"


class Router:
    def __init__(self, config: RouterConfig):
        self.config = config
        self.model = config.served_model_name or config.model_path
        self.tokenizer = load_tokenizer(config.model_path)
        self.eos = eos_token_ids(config.model_path, self.tokenizer)
        hf = read_hf_config(config.model_path)
        self.context_len = int(hf.get("max_position_embeddings") or hf.get("n_positions") or 2048)
        self._channels: dict[str, grpc.aio.Channel] = {}
        self.policies = {"prefill": make_policy(config.prefill_policy, "prefill"),
                         "decode": make_policy(config.decode_policy, "decode")}
        self.workers = {"prefill": config.prefill, "decode": config.decode}
        self.inflight = {url: 0 for url in (*config.prefill, *config.decode)}

    def pick(self, role: str, prompt_ids: list[int]) -> str:
        """A worker of `role` by its policy. NOTE: health and GetLoad are not polled yet (issue 6):
        every worker counts as healthy, and its load is what this router has in flight on it."""
        views = [WorkerView(url, True, 0, self.inflight[url]) for url in self.workers[role]]
        chosen = self.policies[role].pick(views, prompt_ids)
        self.policies[role].on_routed(chosen, prompt_ids)
        return chosen.url

    def channel(self, url: str) -> grpc.aio.Channel:
        """One channel per worker, created on first use: grpc.aio binds it to the running loop."""
        if url not in self._channels:
            self._channels[url] = grpc.aio.insecure_channel(url)
        return self._channels[url]

    async def healthy(self, url: str) -> bool:
        try:
            reply = await health_pb2_grpc.HealthStub(self.channel(url)).Check(health_pb2.HealthCheckRequest(), timeout=2)
            return reply.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.aio.AioRpcError:
            return False

    async def choice(self, prompt_ids: list[int], params, on_text=None) -> Completion:
        """Run one choice through a prefill/decode pair; `on_text(delta)` sees text as it is final."""
        req = Req(secrets.token_hex(8), prompt_ids, params, params.seed or 0)
        req.detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_ids, params.skip_special_tokens)
        decode, prefill = self.pick("decode", prompt_ids), self.pick("prefill", prompt_ids)
        stream = paired_generate(self.channel(decode), self.channel(prefill), prompt_ids, params)
        self.inflight[decode] += 1
        self.inflight[prefill] += 1
        try:
            async for event in stream:
                for token in event.token_ids:
                    before = len(req.text)
                    append_token(req, token, None, self.eos, self.context_len)
                    if on_text is not None and len(req.text) > before:
                        await on_text(req.text[before:])
                    if req.finished:
                        break
                if req.finished or event.kind == "finish":
                    break
        finally:
            await stream.aclose()  # cancels both RPCs if we stopped early (stop string, client gone)
            self.inflight[decode] -= 1
            self.inflight[prefill] -= 1
        if req.finish_reason is None:
            req.finish_reason = FinishReason.LENGTH
        before = len(req.text)
        completion = finalize(req)
        if on_text is not None and len(completion.text) > before:
            await on_text(completion.text[before:])
        return completion


def error_response(e: OpenAIError) -> JSONResponse:
    return JSONResponse(e.to_body(), status_code=e.status_code)


def create_app(router: Router) -> FastAPI:
    app = FastAPI(title="pdserve router", description="OpenAI-compatible front door of a prefill/decode deployment.")

    async def body_of(request: Request) -> dict:
        if router.config.api_key and request.headers.get("authorization") != f"Bearer {router.config.api_key}":
            raise OpenAIError("invalid or missing API key (Authorization: Bearer ...)", status_code=401)
        try:
            body = json.loads(await request.body())
        except ValueError as e:
            raise OpenAIError(f"the request body is not valid JSON: {e}") from e
        if not isinstance(body, dict):
            raise OpenAIError("the request body must be a JSON object")
        return body

    async def handle(request: Request, parse):
        try:
            body = await body_of(request)
            parsed = parse(body, router.tokenizer, router.model, router.context_len, allow_stream=True)
        except OpenAIError as e:
            return error_response(e)
        choices = [(ids, fix_seed(p)) for ids, p in parsed.engine_requests()]
        request_id, created = secrets.token_hex(12), int(time.time())
        if parsed.stream:
            return StreamingResponse(stream(parsed, choices, request_id, created), media_type="text/event-stream")
        try:
            completions = await asyncio.gather(*(router.choice(ids, p) for ids, p in choices))
        except UpstreamError as e:
            return error_response(OpenAIError(str(e), status_code=e.status))
        return JSONResponse(format_response(parsed, list(completions), router.tokenizer, request_id, created))

    async def stream(parsed: ParsedRequest, choices, request_id: str, created: int):
        chat = parsed.kind == "chat"
        prefix, kind = ("chatcmpl-", "chat.completion.chunk") if chat else ("cmpl-", "text_completion")
        queue: asyncio.Queue = asyncio.Queue()

        def chunk(index: int, text: str | None, finish: str | None, role: bool = False) -> str:
            if chat:
                delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
                body = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                body = {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish}
            return json.dumps({"id": prefix + request_id, "object": kind, "created": created, "model": parsed.model,
                               "choices": [body]})

        async def run(index: int, ids, params):
            async def on_text(delta: str):
                await queue.put(chunk(index, delta, None))

            try:
                completion = await router.choice(ids, params, on_text)
                await queue.put(chunk(index, None, completion.finish_reason.value))
                return completion
            except UpstreamError as e:
                await queue.put(json.dumps(OpenAIError(str(e), status_code=e.status).to_body()))
                return None

        if chat:
            for i in range(len(choices)):
                yield f"data: {chunk(i, None, None, role=True)}\n\n"
        tasks = [asyncio.create_task(run(i, ids, p)) for i, (ids, p) in enumerate(choices)]
        try:
            waiter = asyncio.gather(*tasks)
            while not waiter.done() or not queue.empty():
                try:
                    item = await asyncio.wait_for(queue.get(), 0.05)
                except asyncio.TimeoutError:
                    continue
                yield f"data: {item}\n\n"
            completions = waiter.result()
            if parsed.include_usage and all(c is not None for c in completions):
                yield "data: " + json.dumps({"id": prefix + request_id, "object": kind, "created": created,
                                             "model": parsed.model, "choices": [], "usage": usage(parsed, completions)}) + "\n\n"
            yield "data: [DONE]\n\n"
        finally:
            for task in tasks:  # the client went away: cancel both sides of every choice
                task.cancel()

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, parse_completion_request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, parse_chat_request)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": router.model, "object": "model", "created": 0, "owned_by": "pdserve"}]}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/readiness")
    async def readiness():
        prefill = [u for u in router.config.prefill if await router.healthy(u)]
        decode = [u for u in router.config.decode if await router.healthy(u)]
        ok = bool(prefill and decode)
        return JSONResponse({"ready": ok, "prefill": prefill, "decode": decode}, status_code=200 if ok else 503)

    return app
