"""The router's HTTP app: the Router, one per router process, and `create_app`, which serves it.

The Router holds what every request needs (the tokenizer, the worker registry and its health checks,
the routing policies, admission, the metrics) and runs one choice: pick a decode server (and a
prefill server, unless the decode server prefills it: router/disagg.py), pair them
(router/pairing.py), and turn the tokens they stream into text by the engine's own output rules.
The endpoints live by what they serve: router/openai_routes.py (/v1/completions,
/v1/chat/completions), router/native_routes.py (/generate) and router/operations_routes.py
(/health, /readiness, /metrics, /v1/models), router/tokenize_routes.py (/tokenize, /detokenize),
router/responses_routes.py (/v1/responses);
create_app puts them on one FastAPI app.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request

from pdserve.common.config import read_hf_config, short_model_name
from pdserve.common.detokenizer import IncrementalDetokenizer
from pdserve.common.openai.api import OpenAIError
from pdserve.common.openai.defaults import load_generation_defaults
from pdserve.common.scheduling.output_processor import append_token, finalize
from pdserve.common.tokenizer import eos_token_ids, load_tokenizer
from pdserve.common.tracing import start_tracing
from pdserve.common.types import Completion, FinishReason, Req
from pdserve.router import migration
from pdserve.router.admission import Admission
from pdserve.router.body_parser import BodyParser
from pdserve.router.config import RouterConfig
from pdserve.router.decode_streams import DecodeStreams
from pdserve.router.disagg import Disaggregation, Where
from pdserve.router.http_answers import error_response
from pdserve.router.loop_lag import LoopLag
from pdserve.router.metrics import RouterMetrics
from pdserve.router.native_routes import native_routes
from pdserve.router.openai_routes import openai_routes
from pdserve.router.operations_routes import operations_routes
from pdserve.router.pairing import (
    EventKind,
    UpstreamError,
    local_generate,
    paired_generate,
    prefill_only,
    prompt_logprobs_of,
)
from pdserve.router.policies import make_policy
from pdserve.router.prefill_attempts import abandon as abandon_prefills
from pdserve.router.responses_routes import responses_routes
from pdserve.router.timings import ChoiceTimings
from pdserve.router.tokenize_routes import tokenize_routes
from pdserve.router.workers import WorkerRegistry, resolve_dns

log = logging.getLogger(__name__)

OUTAGE_LOG_S = 10.0  # at most one line this often while no prefill server is healthy


class Router:
    def __init__(self, config: RouterConfig, resolve=None):
        self.config = config
        self.started_file: str | None = None  # set by a supervised worker (router/serve.py)
        self._started = False
        self.model = config.served_model_name or short_model_name(config.model_path)
        self.aliases = (config.model_path,)  # the path as given is a name of the model too
        self.defaults = load_generation_defaults(
            config.model_path, config.generation_config, config.override_generation_config, config.default_max_tokens
        )
        log.info("%s", self.defaults.describe())
        self.tokenizer = load_tokenizer(config.model_path)
        self.eos = eos_token_ids(config.model_path, self.tokenizer)
        hf = read_hf_config(config.model_path)
        self.context_len = config.context_length or int(
            hf.get("max_position_embeddings") or hf.get("n_positions") or 2048
        )
        # Token ids both the tokenizer and the model's embedding take (either may have extra rows).
        self.vocab_size = min(len(self.tokenizer), int(hf.get("vocab_size") or len(self.tokenizer)))
        # Bounds checked before a body is parsed or a prompt tokenized (router/http_requests.py).
        self.max_body_bytes = config.max_body_bytes or max(16 << 20, 64 * self.context_len)
        self.longest_token_chars = max(map(len, self.tokenizer.get_vocab()), default=1)
        self.admission = Admission(config.max_inflight, config.max_queued, config.queue_timeout)
        self.loop_lag = LoopLag()
        # Heavy work, off the event loop (a large body parsed and tokenized, a large answer written:
        # router/http_requests.py, router/large_answers.py). NOTE: one thread: Python threads hand the
        # GIL among themselves, and the loop's thread waits its turn behind all of them (8 echo answers
        # built at once held the loop ~20 ms on 2 or 6 threads, ~5 ms on 1; DNS stays on asyncio's own).
        self.off_loop = ThreadPoolExecutor(1, thread_name_prefix="router-off-loop")
        self.body_parser = BodyParser()  # bodies of 128 KiB and more: parsed in a process (router/body_parser.py)
        self.registry = WorkerRegistry(
            config,
            resolve=resolve or resolve_dns,
            on_removed=self._removed,
            loop_lag=self.loop_lag,
            on_unresponsive=self._unresponsive,
        )
        self.decode_streams: dict[str, DecodeStreams] = {}  # decode url -> its shared GenerateMany call
        self._closing: set[asyncio.Task] = set()
        self.metrics = RouterMetrics(self.registry, self.loop_lag)
        self.tracer = start_tracing("pdserve-router", config.otlp_traces_endpoint)  # None: not tracing
        self.inflight = 0
        self.policies = {
            "prefill": make_policy(config.prefill_policy, "prefill"),
            "decode": make_policy(config.decode_policy, "decode"),
        }
        c = config
        self.disagg = Disaggregation(
            c.disagg_policy, c.local_prefill_max_tokens, c.prefill_queue_threshold, c.prefill_fallback
        )
        self._outage_logged = -math.inf  # when the last "no healthy prefill server" line was logged

    async def start(self) -> None:
        self.loop_lag.start()
        await self.registry.start()

    async def stop(self) -> None:
        for streams in self.decode_streams.values():
            await streams.close()
        await self.registry.stop()
        await self.loop_lag.stop()
        self.off_loop.shutdown(wait=False, cancel_futures=True)
        self.body_parser.close()

    def _removed(self, role: str, url: str) -> None:
        self.policies[role].on_removed(url)
        streams = self.decode_streams.pop(url, None)
        if streams is not None:  # its requests fail, as they would on a closed channel
            task = asyncio.ensure_future(streams.close())
            self._closing.add(task)  # (a task nothing references may be collected mid-run)
            task.add_done_callback(self._closing.discard)

    def _unresponsive(self, role: str, url: str) -> None:
        """A worker failing its health checks is hung or gone: what it holds ends now rather than at its
        deadline, a decode server's streams with an error, a prefill server's attempts retried elsewhere
        (they have produced no token). Only what has waited for as long as the failed checks took to add
        up (at least): a decode server only slow to answer checks but still streaming keeps its streams."""
        enough = self.config.circuit_failures * self.config.health_check_interval
        checks = f"{self.registry.workers[url].failures} health checks failed in a row"
        if role == "prefill":
            why = f"prefill server {url} stopped answering: {checks}"
            if ended := abandon_prefills(url, enough, why):
                log.warning("%s: %d prefill attempts ended", why, ended)
            return
        streams = self.decode_streams.get(url)
        if streams is None or not streams.streams:
            return
        silent = time.monotonic() - streams.last_heard
        if silent < enough:
            return
        why = f"decode server {url} stopped answering: {checks} and its streams were silent for {silent:.1f}s"
        failed = streams.abandon(why)
        log.warning("%s: %d streams ended", why, failed)

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

    def started(self) -> bool:
        """This process's router has started: every worker of a supervised router serves and its warm
        spare is built (the supervisor says so once, with a file: router/supervisor.py); until then
        /readiness answers 503, so that `pdserve up`, a benchmark or a Kubernetes probe does not send
        its first burst while the other workers still load their tokenizers (one core each, for
        seconds) and the kernel gives every connection to the few already listening."""
        if not self._started and (self.started_file is None or os.path.exists(self.started_file)):
            self._started = True
        return self._started

    def serving(self) -> bool:
        """A healthy decode server, and a healthy prefill server unless decode servers may prefill."""
        ready, c = self.ready(), self.config
        may_prefill = c.disagg_policy != "always" or c.prefill_fallback == "local"  # decode servers may
        return bool(ready["decode"] and (ready["prefill"] or may_prefill))

    def unserved(self) -> str:
        """A request refused for want of servers: why (a 503's message), counted, and logged once per
        OUTAGE_LOG_S while it lasts."""
        ready = self.ready()
        if ready["decode"]:
            self.metrics.prefill_decisions.labels("failed", "no_prefill_server").inc()
            self._log_outage("requests fail (--prefill-fallback fail)")
            return "no healthy prefill server (--prefill-fallback local would have decode servers prefill)"
        return "no healthy decode server" if ready["prefill"] else "no healthy prefill or decode server"

    def _log_outage(self, what: str) -> None:
        now = time.monotonic()
        if now - self._outage_logged >= OUTAGE_LOG_S:
            self._outage_logged = now
            log.warning("no healthy prefill server: %s", what)

    async def choice(
        self, prompt_ids: list[int], params, on_text=None, on_prompt=None, arrived=None, trace=None
    ) -> Completion:
        """Run one choice through a prefill/decode pair; `on_text(delta, logprobs)` sees text as it
        becomes final, with the logprobs of the tokens that produced it (when requested), and
        `on_prompt(prompt_logprobs)` is called once, when the prefill has answered (before any text;
        None unless asked for). `arrived`: its request's arrival (time.monotonic(); None: now), where
        its timings start; `trace`: the client's W3C trace headers (router/timings.py)."""
        clock = ChoiceTimings(time.monotonic() if arrived is None else arrived, self.tracer, trace)
        with clock.traced(self.model, len(prompt_ids)):
            return await self._choice(prompt_ids, params, on_text, on_prompt, clock)

    async def _choice(self, prompt_ids: list[int], params, on_text, on_prompt, clock: ChoiceTimings) -> Completion:
        req = Req(secrets.token_hex(8), prompt_ids, params, params.seed or 0)
        req.detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_ids, params.skip_special_tokens)
        req.stream_text = True
        workers = self.registry.workers

        def pick_prefill(tried):
            if tried:
                self.metrics.retries.inc()
                clock.event("prefill_retry", {"pdserve.failed_prefill_server": tried[-1]})
            url = self.pick("prefill", prompt_ids, exclude=tried)
            return None if url is None else (url, workers[url].channel)

        if params.max_new_tokens == 0:
            return await self._prompt_only(req, pick_prefill, on_prompt, clock)
        decode = self.pick("decode", prompt_ids)
        if decode is None:
            raise UpstreamError("no healthy decode server", 503)
        decode_worker = workers[decode]
        where, stream = self._decode_stream(decode, prompt_ids, params, pick_prefill)
        decode_worker.inflight += 1
        started, last, reported, emitted = time.monotonic(), None, 0, 0
        failed: list[str] = []  # decode servers this choice was moved away from (router/migration.py)
        # Text a stop string could still claim is held back until the stop is ruled out (vLLM's
        # stop buffer): a stop found later cuts req.text, and what a stream sent cannot be taken back.
        hold = max(map(len, params.stop), default=1) - 1
        try:
            while True:  # (once, plus once per migration)
                try:
                    async for event in stream:
                        now = time.monotonic()
                        clock.saw(event, now)
                        if event.token_ids:
                            if last is None:
                                self.metrics.ttft.observe(now - started)
                            else:
                                self.metrics.itl.observe((now - last) / len(event.token_ids))
                            last = now
                        if (
                            event.cached_tokens is not None and not failed
                        ):  # the first event (the prefill's answer), or a local prefill's finish
                            req.cached_tokens = event.cached_tokens
                            req.kv_transfer_bytes = event.kv_transfer_bytes
                            req.prompt_logprobs = event.prompt_logprobs
                            if on_prompt is not None and event.kind is EventKind.TOKENS:
                                await on_prompt(req.prompt_logprobs)
                        logprobs = event.logprobs if params.logprobs is not None else []
                        for i, token in enumerate(event.token_ids):
                            append_token(
                                req, token, logprobs[i] if i < len(logprobs) else None, self.eos, self.context_len
                            )
                            if req.finished:
                                break
                        # One delta per event: a chunk of several tokens (a stream that fell behind) is
                        # one SSE event, as in vLLM, not one per token.
                        final = len(req.text) if req.finished else len(req.text) - hold
                        if on_text is not None and final > emitted:
                            await on_text(req.text[emitted:final], req.output_logprobs[reported:])
                            emitted, reported = final, len(req.output_logprobs)
                        if event.kind is EventKind.FINISH or (req.finished and where is Where.REMOTE):
                            break  # (local: its cached tokens come last)
                    break
                except UpstreamError as e:
                    if e.decode_failed and decode in workers:
                        self.registry.record(decode, ok=False)
                    failed.append(decode)
                    to = self._migration_target(e, req, failed)
                    if to is None:
                        raise
                    await stream.aclose()
                    decode_worker.inflight -= 1
                    sent = len(req.output_ids)
                    log.warning(
                        "choice %s moved from decode server %s to %s after %d tokens: %s", req.rid, decode, to, sent, e
                    )
                    self.metrics.migrations.labels(e.reason or "decode_failed").inc()
                    clock.event("migration", {"pdserve.from": decode, "pdserve.to": to, "pdserve.tokens_sent": sent})
                    decode, decode_worker = to, workers[to]
                    decode_worker.inflight += 1
                    where, stream = self._decode_stream(
                        decode, *migration.resumed(prompt_ids, req.output_ids, params), pick_prefill
                    )
        finally:
            await stream.aclose()  # cancels both RPCs if we stopped early (stop string, client gone)
            decode_worker.inflight -= 1  # (the worker may have left the registry meanwhile)
        if decode in workers:
            self.registry.record(decode, ok=True)
        if req.finish_reason is None:
            req.finish_reason = FinishReason.LENGTH
        completion = self._finish(req, clock, started)
        # The last chunk also carries logprobs of tokens that added no text (an EOS or stop id):
        # a streamed answer reports the same tokens' logprobs as the whole one.
        if on_text is not None and (len(completion.text) > emitted or len(req.output_logprobs) > reported):
            await on_text(completion.text[emitted:], req.output_logprobs[reported:])
        return completion

    def _decode_stream(self, decode: str, prompt_ids: list[int], params, pick_prefill):
        """(where, events) of a choice on the decode server `decode`: prefilled by a prefill server or
        by `decode` itself, as router/disagg.py decides."""
        c = self.config
        where, why = self.disagg.decide(
            decode, prompt_ids, params.prompt_logprobs is not None, lambda: self.registry.views("prefill")
        )
        self.metrics.prefill_decisions.labels(where.value, why).inc()
        if why == "no_prefill_server":
            self._log_outage(f"decode servers prefill requests themselves (--disagg-policy {c.disagg_policy})")
        if where is Where.LOCAL:
            return where, local_generate(self.decode_target(decode), prompt_ids, params, c)
        return where, paired_generate(
            self.decode_target(decode), pick_prefill, self.registry.record, prompt_ids, params, c
        )

    def _migration_target(self, error: UpstreamError, req: Req, failed: list[str]) -> str | None:
        """The decode server a choice whose stream failed with `error` moves to (router/migration.py), or
        None: it ends with the error (not the decode server's fault, --max-migrations used up, or no
        other healthy decode server)."""
        if not error.decode_failed or len(failed) > self.config.max_migrations or req.finished:
            return None
        return self.pick("decode", req.prompt_ids, exclude=failed)

    async def _prompt_only(self, req: Req, pick_prefill, on_prompt, clock: ChoiceTimings) -> Completion:
        """A choice of no new tokens (its prompt scored, say): a prefill alone, no decode server."""
        started = time.monotonic()
        response = await prefill_only(pick_prefill, self.registry.record, req.prompt_ids, req.params, self.config)
        clock.prefill = response.timings
        req.cached_tokens = response.cached_tokens
        req.prompt_logprobs = await prompt_logprobs_of(response, req.params)
        req.finish_reason = FinishReason.LENGTH
        if on_prompt is not None:
            await on_prompt(req.prompt_logprobs)
        return self._finish(req, clock, started)

    def _finish(self, req: Req, clock: ChoiceTimings, started: float) -> Completion:
        """The choice's completion, its latency histograms (e2e; TPOT from 2 tokens) and timings."""
        ended = time.monotonic()
        self.metrics.e2e.observe(ended - started)
        completion = finalize(req)
        clock.finish(completion, ended)
        if len(completion.output_ids) > 1:
            self.metrics.tpot.observe(clock.timings["decode_s"] / (len(completion.output_ids) - 1))
        return completion


def create_app(router: Router) -> FastAPI:
    """The router's FastAPI app: `router`'s lifetime, OpenAI's error body for the router's own bugs,
    and the endpoints, grouped by what they serve."""

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

    app.include_router(openai_routes(router))
    app.include_router(native_routes(router))
    app.include_router(operations_routes(router))
    app.include_router(tokenize_routes(router))
    app.include_router(responses_routes(router))
    return app
