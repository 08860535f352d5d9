"""Where a choice's time went, stage by stage: its request's log line (router/openai_routes.py
`log_request`) and, when the request asks with "return_timings", its answer (docs/deploy/observe.md).

The stages, in seconds; each from the clock of the process it ran in:

    router_queue_s      router: the request's arrival to the choice's start (its body read and
                        tokenized, its turn at admission)
    prefill_queue_s     prefill server: the request's arrival to its first prefill batch
    prefill_s           prefill server: the prefill forward(s), to the first token
    destination_wait_s  prefill server: the first token to the KV transfer's start (the decode server
                        granted pages after the prompt was computed)
    transfer_s          prefill server: the KV transfer
    first_token_s       router: the request's arrival to the choice's first token (its TTFT)
    decode_s            router: the first token to the choice's end
    total_s             router: the request's arrival to the choice's end

The first five run one after another within first_token_s (what is left of it is the network and the
hand-offs between processes), and first_token_s + decode_s = total_s. A choice the decode server
prefilled itself has its queue and prefill there, and no destination wait or transfer. After a retried
prefill or a migration, the servers' stages are those of the last attempt. (The decode server's own
stages are its histograms': the router ends a choice on its last token, before the decode server's
finish, which carries them, arrives.)

Traced (--otlp-traces-endpoint, common/tracing.py), a choice is a span, "pdserve.request", from its
request's arrival to its end, under the client's traceparent when it sent one, with its router queue
as a child span; the servers' spans go under it (common/serving/request_spans.py).
"""

from __future__ import annotations

import time
from contextlib import contextmanager

from pdserve.common.tracing import OUTGOING_TRACE, wall_ns
from pdserve.router.pairing import Event, EventKind

STAGES = (
    "router_queue_s",
    "prefill_queue_s",
    "prefill_s",
    "destination_wait_s",
    "transfer_s",
    "first_token_s",
    "decode_s",
    "total_s",
)


def client_trace(headers) -> dict[str, str]:
    """The W3C trace context a client's request headers carry (none: {})."""
    return {name: headers[name] for name in ("traceparent", "tracestate") if name in headers}


class ChoiceTimings:
    """One choice's clock: fed every event of its streams (`saw`), read once it ended (`finish`); traced,
    its span (`traced`)."""

    def __init__(self, arrived: float, tracer=None, client: dict[str, str] | None = None):
        self.arrived = arrived  # time.monotonic(): the request's arrival
        self.started = time.monotonic()  # the choice's
        self.tracer, self.client = tracer, client or {}  # (tracer None: not traced)
        self.first_token: float | None = None
        self.prefill = None  # the prefill's pb.Timings, from its answer
        self.decode = None  # the decode server's pb.DecodeTimings, from its finish
        self.ended: float | None = None
        self.timings: dict[str, float] | None = None
        self.span_attributes: dict = {}
        self.span = None  # while traced

    @contextmanager
    def traced(self, model: str, prompt_tokens: int):
        """Run the choice in its span (when traced): the requests it sends carry the span's context."""
        if self.tracer is None:
            yield
            return
        tracer = self.tracer
        attributes = {"gen_ai.request.model": model, "gen_ai.usage.input_tokens": prompt_tokens}
        span = tracer.start(
            "pdserve.request", tracer.context_of(self.client), wall_ns(self.arrived), server=True, attributes=attributes
        )
        token, self.span = OUTGOING_TRACE.set(tracer.carrier_of(span)), span
        try:
            yield
        except BaseException as e:  # (a cancelled choice too: its client went away)
            tracer.fail(span, f"{type(e).__name__}: {e}")
            raise
        finally:
            OUTGOING_TRACE.reset(token)
            tracer.span("router_queue", span, wall_ns(self.arrived), wall_ns(self.started))
            span.set_attributes(self.span_attributes)
            span.end(end_time=wall_ns(self.ended if self.ended is not None else time.monotonic()))
            self.span = None

    def event(self, name: str, attributes: dict) -> None:
        """Something that happened to the choice (a prefill retried, a migration): an event of its span."""
        if self.span is not None:
            self.span.add_event(name, attributes)

    def finish(self, completion, now: float) -> None:
        """The choice ended at `now` with `completion`: its timings (completion.timings) and span attributes."""
        self.ended = now
        completion.timings = self.timings = self.breakdown(now)
        self.span_attributes = {
            "gen_ai.usage.output_tokens": len(completion.output_ids),
            "gen_ai.response.finish_reasons": [completion.finish_reason.value],
        } | {f"pdserve.{stage}": seconds for stage, seconds in self.timings.items()}

    def saw(self, event: Event, now: float) -> None:
        if event.token_ids and self.first_token is None:
            self.first_token = now
        if event.timings is None:
            return
        if event.kind is EventKind.FINISH:
            self.decode = event.timings
        else:
            self.prefill = event.timings

    def breakdown(self, now: float) -> dict[str, float]:
        """Every stage of STAGES (0 for one the choice did not pass), rounded to the microsecond."""
        first = self.first_token if self.first_token is not None else now
        stages = dict.fromkeys(STAGES, 0.0)
        stages["router_queue_s"] = self.started - self.arrived
        if self.prefill is not None:
            p = self.prefill
            stages["prefill_queue_s"], stages["prefill_s"] = p.queue_s, p.prefill_s
            stages["destination_wait_s"], stages["transfer_s"] = p.destination_wait_s, p.transfer_s
        elif self.decode is not None:  # prefilled by the decode server (GenerateRequest.local_prefill)
            stages["prefill_queue_s"], stages["prefill_s"] = self.decode.queue_s, self.decode.prefill_s
        stages["first_token_s"] = first - self.arrived
        stages["decode_s"] = now - first
        stages["total_s"] = now - self.arrived
        return {stage: round(max(seconds, 0.0), 6) for stage, seconds in stages.items()}


def describe(timings: dict[str, float]) -> str:
    """The log line's form, in milliseconds: "stages ms: router_queue 0.1, prefill_queue 0.3, ..., total 84.0"."""
    return "stages ms: " + ", ".join(
        f"{stage.removesuffix('_s')} {seconds * 1e3:.1f}" for stage, seconds in timings.items()
    )
