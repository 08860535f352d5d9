"""The router's HTTP API (OpenAI-compatible): validate, tokenize, wait for a turn (admission),
pair a prefill and a decode worker per choice, stream or collect the tokens, answer in OpenAI's
shapes.

Bodies are validated by common/openai/api.py (the same rules as run-batch) and answered by
common/openai/format.py; streaming follows OpenAI's SSE chunks, `stream_options.include_usage`
and `data: [DONE]`. Every error a client sees is OpenAI's error body: 400/404 for the body, 429
(with Retry-After) when the router's queue is full or a request's turn does not come in time
(router/admission.py), 5xx only for the servers' failures.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from pdserve.common.config import read_hf_config
from pdserve.common.detokenizer import IncrementalDetokenizer
from pdserve.common.openai.api import OpenAIError, ParsedRequest, parse_completion_request
from pdserve.common.openai.chat import parse_chat_request
from pdserve.common.openai.format import format_response
from pdserve.common.scheduling.output_processor import append_token, finalize
from pdserve.common.tokenizer import eos_token_ids, load_tokenizer
from pdserve.common.types import Completion, FinishReason, Req
from pdserve.router.admission import Admission, Overloaded
from pdserve.router.config import RouterConfig
from pdserve.router.decode_streams import DecodeStreams
from pdserve.router.disagg import Disaggregation
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
from pdserve.router.metrics import RouterMetrics
from pdserve.router.pairing import (
    UpstreamError,
    fix_seed,
    local_generate,
    paired_generate,
    prefill_only,
    prompt_logprobs_of,
)
from pdserve.router.policies import make_policy
from pdserve.router.stream_chunks import StreamChunks
from pdserve.router.workers import WorkerRegistry, resolve_dns

log = logging.getLogger(__name__)


class Router:
    def __init__(self, config: RouterConfig, resolve=None):
        self.config = config
        self.model = config.served_model_name or config.model_path
        self.tokenizer = load_tokenizer(config.model_path)
        self.eos = eos_token_ids(config.model_path, self.tokenizer)
        hf = read_hf_config(config.model_path)
        self.context_len = int(hf.get("max_position_embeddings") or hf.get("n_positions") or 2048)
        # Token ids both the tokenizer and the model's embedding take (either may have extra rows).
        self.vocab_size = min(len(self.tokenizer), int(hf.get("vocab_size") or len(self.tokenizer)))
        self.admission = Admission(config.max_inflight, config.max_queued, config.queue_timeout)
        self.registry = WorkerRegistry(config, resolve=resolve or resolve_dns, on_removed=self._removed)
        self.decode_streams: dict[str, DecodeStreams] = {}  # decode url -> its shared GenerateMany call
        self._closing: set[asyncio.Task] = set()
        self.metrics = RouterMetrics(self.registry)
        self.inflight = 0
        self.policies = {
            "prefill": make_policy(config.prefill_policy, "prefill"),
            "decode": make_policy(config.decode_policy, "decode", config.disagg_policy != "always"),
        }
        self.disagg = Disaggregation(
            config.disagg_policy, config.local_prefill_max_tokens, config.prefill_queue_threshold
        )

    async def start(self) -> None:
        await self.registry.start()

    async def stop(self) -> None:
        for streams in self.decode_streams.values():
            await streams.close()
        await self.registry.stop()

    def _removed(self, role: str, url: str) -> None:
        self.policies[role].on_removed(url)
        streams = self.decode_streams.pop(url, None)
        if streams is not None:  # its requests fail, as they would on a closed channel
            task = asyncio.ensure_future(streams.close())
            self._closing.add(task)  # (a task nothing references may be collected mid-run)
            task.add_done_callback(self._closing.discard)

    def decode_target(self, url: str):
        """What paired_generate opens a decode stream on: the server's shared call, or its channel."""
        channel = self.registry.workers[url].channel
        if self.config.decode_stream == "per-request":
            return channel
        streams = self.decode_streams.get(url)
        if streams is None:
            streams = self.decode_streams[url] = DecodeStreams(channel)
        return streams

    def pick(self, role: str, prompt_ids: list[int], exclude=()) -> str | None:
        views = [v for v in self.registry.views(role) if v.url not in exclude]
        chosen = self.policies[role].pick(views, prompt_ids)
        if chosen is None:
            return None
        self.policies[role].on_routed(chosen, prompt_ids)
        return chosen.url

    def ready(self) -> dict:
        return {role: [v.url for v in self.registry.views(role) if v.healthy] for role in ("prefill", "decode")}

    def serving(self) -> bool:
        """A healthy decode server, and a healthy prefill server unless decode servers may prefill."""
        ready = self.ready()
        return bool(ready["decode"] and (ready["prefill"] or self.config.disagg_policy != "always"))

    async def choice(self, prompt_ids: list[int], params, on_text=None, on_prompt=None) -> Completion:
        """Run one choice through a prefill/decode pair; `on_text(delta, logprobs)` sees text as it
        becomes final, with the logprobs of the tokens that produced it (when requested), and
        `on_prompt(prompt_logprobs)` is called once, when the prefill has answered (before any text;
        None unless asked for)."""
        req = Req(secrets.token_hex(8), prompt_ids, params, params.seed or 0)
        req.detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_ids, params.skip_special_tokens)
        req.stream_text = True
        workers = self.registry.workers

        def pick_prefill(tried):
            if tried:
                self.metrics.retries.inc()
            url = self.pick("prefill", prompt_ids, exclude=tried)
            return None if url is None else (url, workers[url].channel)

        if params.max_new_tokens == 0:
            return await self._prompt_only(req, pick_prefill, on_prompt)
        decode = self.pick("decode", prompt_ids)
        if decode is None:
            raise UpstreamError("no healthy decode server", 503)
        decode_worker, c = workers[decode], self.config
        where, why = self.disagg.decide(
            decode, prompt_ids, params.prompt_logprobs is not None, lambda: self.registry.views("prefill")
        )
        self.metrics.prefill_decisions.labels(where, why).inc()
        stream = (
            local_generate(self.decode_target(decode), prompt_ids, params, c)
            if where == "local"
            else paired_generate(self.decode_target(decode), pick_prefill, self.registry.record, prompt_ids, params, c)
        )
        decode_worker.inflight += 1
        started, last, reported, emitted = time.monotonic(), None, 0, 0
        # Text a stop string could still claim is held back until the stop is ruled out (vLLM's
        # stop buffer): a stop found later cuts req.text, and what a stream sent cannot be taken back.
        hold = max(map(len, params.stop), default=1) - 1
        try:
            async for event in stream:
                now = time.monotonic()
                if event.token_ids:
                    if last is None:
                        self.metrics.ttft.observe(now - started)
                    else:
                        self.metrics.itl.observe((now - last) / len(event.token_ids))
                    last = now
                if (
                    event.cached_tokens is not None
                ):  # the first event (the prefill's answer), or a local prefill's finish
                    req.cached_tokens = event.cached_tokens
                    req.prompt_logprobs = event.prompt_logprobs
                    if on_prompt is not None and event.kind == "tokens":
                        await on_prompt(req.prompt_logprobs)
                logprobs = event.logprobs if params.logprobs is not None else []
                for i, token in enumerate(event.token_ids):
                    append_token(req, token, logprobs[i] if i < len(logprobs) else None, self.eos, self.context_len)
                    if req.finished:
                        break
                # One delta per event: a chunk of several tokens (a stream that fell behind) is
                # one SSE event, as in vLLM, not one per token.
                final = len(req.text) if req.finished else len(req.text) - hold
                if on_text is not None and final > emitted:
                    await on_text(req.text[emitted:final], req.output_logprobs[reported:])
                    emitted, reported = final, len(req.output_logprobs)
                if event.kind == "finish" or (
                    req.finished and where == "remote"
                ):  # (local: its cached tokens come last)
                    break
        except UpstreamError as e:
            if e.decode_failed and decode in workers:
                self.registry.record(decode, ok=False)
            raise
        finally:
            await stream.aclose()  # cancels both RPCs if we stopped early (stop string, client gone)
            decode_worker.inflight -= 1  # (the worker may have left the registry meanwhile)
        if decode in workers:
            self.registry.record(decode, ok=True)
        if req.finish_reason is None:
            req.finish_reason = FinishReason.LENGTH
        self.metrics.e2e.observe(time.monotonic() - started)
        completion = finalize(req)
        # The last chunk also carries logprobs of tokens that added no text (an EOS or stop id):
        # a streamed answer reports the same tokens' logprobs as the whole one.
        if on_text is not None and (len(completion.text) > emitted or len(req.output_logprobs) > reported):
            await on_text(completion.text[emitted:], req.output_logprobs[reported:])
        return completion

    async def _prompt_only(self, req: Req, pick_prefill, on_prompt) -> Completion:
        """A choice of no new tokens (its prompt scored, say): a prefill alone, no decode server."""
        started = time.monotonic()
        response = await prefill_only(pick_prefill, self.registry.record, req.prompt_ids, req.params, self.config)
        req.cached_tokens = response.cached_tokens
        req.prompt_logprobs = prompt_logprobs_of(response, req.params)
        req.finish_reason = FinishReason.LENGTH
        if on_prompt is not None:
            await on_prompt(req.prompt_logprobs)
        self.metrics.e2e.observe(time.monotonic() - started)
        return finalize(req)


def create_app(router: Router) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app):
        await router.start()  # channels and health checks live on the server's event loop
        yield
        await router.stop()

    app = FastAPI(
        title="pdserve router",
        description="OpenAI-compatible front door of a prefill/decode deployment.",
        lifespan=lifespan,
    )

    @app.exception_handler(Exception)
    async def bug(request: Request, e: Exception):
        """A failure nothing else caught is the router's bug; the client still gets OpenAI's error
        body (and the traceback goes to the log)."""
        log.error("unhandled error on %s", request.url.path, exc_info=e)
        return error_response(OpenAIError(f"internal error of the router: {type(e).__name__}", status_code=500))

    async def body_of(request: Request) -> dict:
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

    def parse_body(parse, body: dict):
        return parse(
            body,
            router.tokenizer,
            router.model,
            router.context_len,
            allow_stream=True,
            max_choices=router.config.max_choices,
            vocab_size=router.vocab_size,
        )

    async def admit(request: Request, choices: int) -> int:
        """Wait for the request's turn (its slots); Overloaded or ClientGone when it does not come."""
        return await until_disconnect(
            request, router.admission.acquire(min(choices, router.config.max_choices_at_once))
        )

    async def handle(request: Request, parse):
        response = await answer(request, parse)
        router.metrics.requests.labels(status=str(response.status_code)).inc()
        return response

    async def answer(request: Request, parse):
        try:
            parsed = parse_body(parse, await body_of(request))
        except OpenAIError as e:
            return error_response(e)
        if not router.serving():
            return error_response(OpenAIError("no healthy prefill or decode server", status_code=503))
        choices = [(ids, fix_seed(p)) for ids, p in parsed.engine_requests()]
        try:
            lanes = await admit(request, len(choices))
        except Overloaded as e:
            return overloaded_response(e)
        except ClientGone:
            return JSONResponse({}, status_code=499)
        request_id, created = secrets.token_hex(12), int(time.time())
        if parsed.stream:
            return AdmittedStream(
                counted(stream(parsed, choices, lanes, request_id, created)),
                lambda: router.admission.release(lanes),
                media_type="text/event-stream",
            )
        router.inflight += 1
        try:
            completions = await until_disconnect(
                request, run_choices(choices, lanes, lambda i, ids, p: router.choice(ids, p))
            )
        except UpstreamError as e:
            return upstream_response(e)
        except ClientGone:
            return JSONResponse({}, status_code=499)
        finally:
            router.inflight -= 1
            router.admission.release(lanes)
        return JSONResponse(format_response(parsed, completions, router.tokenizer, request_id, created))

    async def counted(chunks):
        router.inflight += 1
        try:
            async for chunk in chunks:
                yield chunk
        finally:
            router.inflight -= 1

    async def stream(parsed: ParsedRequest, choices, lanes: int, request_id: str, created: int):
        chunks = StreamChunks(parsed, router.tokenizer, request_id, created)
        queue: asyncio.Queue = asyncio.Queue()

        async def run(index: int, ids, params):
            async def on_text(delta: str, logprobs):
                for chunk in chunks.text(index, delta, logprobs):  # none while a tool call is held back
                    await queue.put(chunk)

            async def on_prompt(prompt_logprobs):
                """Echo: the prompt leads the choice's stream, with its logprobs when asked."""
                if parsed.echo:
                    await queue.put(chunks.echo(index, ids, prompt_logprobs))

            try:
                completion = await router.choice(ids, params, on_text, on_prompt)
                for chunk in chunks.finish(index, completion.finish_reason.value):
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
        try:
            async for items in queued_batches(queue, tasks):
                yield "".join(f"data: {item}\n\n" for item in items)
            [completions] = [task.result() for task in tasks]
            if parsed.include_usage and all(c is not None for c in completions):
                yield f"data: {chunks.usage(completions)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            for task in tasks:  # the client went away: cancel both sides of every choice
                task.cancel()

    @app.post("/generate")
    async def generate(request: Request):
        """Native: {"text" | "input_ids", "sampling_params": {OpenAI completion fields}, "stream"} ->
        {"text", "output_ids", "finish_reason", "usage"} (or SSE of {"text", "output_ids"} deltas)."""
        try:
            body = await body_of(request)
            if ("text" in body) == ("input_ids" in body):
                raise OpenAIError("give exactly one of 'text' or 'input_ids'")
            sampling = body.get("sampling_params") or {}
            if not isinstance(sampling, dict):
                raise OpenAIError("'sampling_params' must be an object")
            openai_body = {
                **sampling,
                "prompt": body.get("text", body.get("input_ids")),
                "stream": bool(body.get("stream")),
            }
            parsed = parse_body(parse_completion_request, openai_body)
        except OpenAIError as e:
            return error_response(e)
        if parsed.n != 1 or len(parsed.prompts) != 1:
            return error_response(OpenAIError("/generate takes one prompt and n = 1"))
        [(ids, params)] = [(i, fix_seed(p)) for i, p in parsed.engine_requests()]
        try:
            lanes = await admit(request, 1)
        except Overloaded as e:
            return overloaded_response(e)
        except ClientGone:
            return JSONResponse({}, status_code=499)
        if parsed.stream:

            async def native_stream():
                queue: asyncio.Queue = asyncio.Queue()

                async def on_text(delta, logprobs):
                    if delta:
                        await queue.put({"text": delta})

                task = asyncio.create_task(router.choice(ids, params, on_text))
                try:
                    async for items in queued_batches(queue, [task]):
                        yield "".join(f"data: {json.dumps(item)}\n\n" for item in items)
                    c = task.result()
                    yield (
                        "data: "
                        + json.dumps({"output_ids": c.output_ids, "finish_reason": c.finish_reason.value})
                        + "\n\n"
                    )
                    yield "data: [DONE]\n\n"
                finally:
                    task.cancel()

            return AdmittedStream(
                native_stream(), lambda: router.admission.release(lanes), media_type="text/event-stream"
            )
        try:
            c = await router.choice(ids, params)
        except UpstreamError as e:
            return upstream_response(e)
        finally:
            router.admission.release(lanes)
        return {
            "text": c.text,
            "output_ids": c.output_ids,
            "finish_reason": c.finish_reason.value,
            "usage": {
                "prompt_tokens": len(ids),
                "completion_tokens": len(c.output_ids),
                "cached_tokens": c.cached_tokens,
            },
        }

    @app.get("/metrics")
    async def metrics():
        router.metrics.update(router.inflight)
        return Response(router.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, parse_completion_request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, parse_chat_request)

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [{"id": router.model, "object": "model", "created": 0, "owned_by": "pdserve"}],
        }

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/readiness")
    async def readiness():
        return JSONResponse({"ready": router.serving(), **router.ready()}, status_code=200 if router.serving() else 503)

    return app
