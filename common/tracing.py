"""OpenTelemetry tracing: one trace per request across the router and both servers, off unless asked.

On in a process given `--otlp-traces-endpoint URL`, or with OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or
OTEL_EXPORTER_OTLP_ENDPOINT set; spans go over OTLP/gRPC in batches, and the SDK reads its other
OTEL_* variables itself (OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES, OTEL_TRACES_SAMPLER,
OTEL_BSP_SCHEDULE_DELAY, OTEL_EXPORTER_OTLP_HEADERS, ...). The SDK is an optional extra
(`pip install 'pdserve[tracing]'`) imported only by a process that traces: one that does not imports
nothing of it and pays one `None` check per request.

Spans are recorded once their times are known (`Tracer.span` takes its start and end): a server's
stages are timed in its scheduler process and reach the frontend with the request's last message
(router/timings.py, decode/timings.py say which stages), so the frontend lays them out then.

The router's context reaches the servers in GenerateRequest.trace_context (W3C traceparent), set
from `OUTGOING_TRACE`, which the router sets in each choice's task (router/timings.py).
"""

from __future__ import annotations

import os
import time
from contextvars import ContextVar
from typing import Mapping

# NOTE: a ContextVar, not an argument: each choice runs in its own task, and the requests it sends
# (router/pairing.py) are built in that task, however deep. None: the choice is not traced.
OUTGOING_TRACE: ContextVar[dict[str, str] | None] = ContextVar("pdserve_outgoing_trace", default=None)

_ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")


def start_tracing(service_name: str, endpoint: str) -> Tracer | None:
    """This process's Tracer, or None when tracing is off (no endpoint given or in the environment)."""
    if not endpoint and not any(os.environ.get(name) for name in _ENDPOINT_VARIABLES):
        return None
    return Tracer(service_name, endpoint)


def wall_ns(monotonic_s: float) -> int:
    """A time.monotonic() reading as Unix time in nanoseconds (what spans carry)."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)


class Tracer:
    """A process's spans, exported over OTLP/gRPC by a batch processor of its own."""

    def __init__(self, service_name: str, endpoint: str, exporter=None):
        """`exporter`: a span exporter of the SDK's to use instead, span by span (tests)."""
        try:
            from opentelemetry import trace
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        except ImportError as e:
            raise RuntimeError(
                "tracing (--otlp-traces-endpoint, or OTEL_EXPORTER_OTLP_*ENDPOINT in the environment) needs the "
                "OpenTelemetry SDK: pip install 'pdserve[tracing]'"
            ) from e
        attributes = {} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": service_name}
        self.provider = TracerProvider(resource=Resource.create(attributes))  # (shut down, and flushed, at exit)
        if exporter is not None:
            from opentelemetry.sdk.trace.export import SimpleSpanProcessor

            self.provider.add_span_processor(SimpleSpanProcessor(exporter))
        else:
            exporter = OTLPSpanExporter(endpoint=endpoint) if endpoint else OTLPSpanExporter()
            self.provider.add_span_processor(BatchSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("pdserve")
        self._trace = trace
        self.propagator = TraceContextTextMapPropagator()

    def context_of(self, carrier: Mapping[str, str]):
        """The context a W3C carrier (traceparent, tracestate) names; an empty one: a new trace."""
        return self.propagator.extract(dict(carrier))

    def carrier_of(self, span) -> dict[str, str]:
        """The W3C carrier of `span`'s context, for the requests sent under it."""
        carrier: dict[str, str] = {}
        self.propagator.inject(carrier, self._trace.set_span_in_context(span))
        return carrier

    def start(self, name: str, parent, start_ns: int, server: bool = False, attributes=None):
        """A span from `start_ns`, under `parent` (a span, or a context from `context_of`); end it
        with `span.end(end_time=...)`."""
        is_span = hasattr(parent, "get_span_context")  # (a context from context_of is a plain mapping)
        context = self._trace.set_span_in_context(parent) if is_span else parent
        kind = self._trace.SpanKind.SERVER if server else self._trace.SpanKind.INTERNAL
        return self.tracer.start_span(name, context, kind, attributes or {}, start_time=start_ns)

    def span(self, name: str, parent, start_ns: int, end_ns: int, attributes=None) -> None:
        """A finished span under `parent`, from `start_ns` to `end_ns`."""
        self.start(name, parent, start_ns, attributes=attributes).end(end_time=max(end_ns, start_ns))

    def fail(self, span, message: str) -> None:
        span.set_status(self._trace.Status(self._trace.StatusCode.ERROR, message))
