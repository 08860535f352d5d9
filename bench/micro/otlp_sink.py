"""An OTLP/gRPC trace receiver: what the tests trace to, and the collector of a tracing-cost run.

    python -m pdserve.bench.micro.otlp_sink --port 4317     # counts spans until Ctrl-C / SIGTERM

    receiver, server = start_receiver(port)                 # in a test: receiver.spans, server.stop(None)

The processes export with OTLP over gRPC (common/tracing.py); this answers every export and keeps
each span with its service's name (or only counts them: a benchmark's hundreds of thousands).
"""

from __future__ import annotations

import argparse
import signal
import threading
from concurrent import futures

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """Keeps every span exported to it as (service.name, span); with keep=False only counts them."""

    def __init__(self, keep: bool = True):
        self.keep = keep
        self.spans: list[tuple[str, object]] = []
        self.count = 0
        self._lock = threading.Lock()

    def Export(self, request, context):
        for resource_spans in request.resource_spans:
            attributes = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                with self._lock:
                    self.count += len(scope_spans.spans)
                    if self.keep:
                        self.spans += [(attributes["service.name"], span) for span in scope_spans.spans]
        return trace_service_pb2.ExportTraceServiceResponse()


def start_receiver(port: int, keep: bool = True, host: str = "127.0.0.1") -> tuple[Receiver, grpc.Server]:
    receiver = Receiver(keep)
    server = grpc.server(futures.ThreadPoolExecutor(2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    server.add_insecure_port(f"{host}:{port}")
    server.start()
    return receiver, server


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pdserve.bench.micro.otlp_sink", description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, default=4317)
    args = parser.parse_args(argv)
    receiver, server = start_receiver(args.port, keep=False)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"OTLP receiver on 127.0.0.1:{args.port}", flush=True)
    stop.wait()
    server.stop(None)
    print(f"spans received: {receiver.count}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
