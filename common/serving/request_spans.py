"""A server's spans of one request (common/tracing.py), recorded by its frontend when the request's last
message arrives: the server's span, from the RPC's arrival to that message, under the router's context
(GenerateRequest.trace_context), and a span per stage under it, laid out from the stage durations the
scheduler measured (PrefillDone's, Finished's DecodeTimings).

The stages run one after another. A prefill's end with its transfer, which ends as its answer is sent:
they are laid out backwards from the end. A decode's start with its queue and end with its decode: the
waits are laid out forwards from the start, the decode backwards from the end. The frontend's hand-offs
to the scheduler process (well under a millisecond) are the gaps.

Attribute names follow OpenTelemetry's GenAI semantic conventions where one exists
(gen_ai.usage.input_tokens, gen_ai.response.finish_reasons); pdserve's own start with "pdserve.".
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from pdserve.common.serving import ipc
from pdserve.common.tracing import Tracer


@dataclass
class Arrival:
    """A traced request's RPC: its parent context and when it arrived (Unix ns)."""

    context: object
    start_ns: int


def record_prefill(tracer: Tracer, arrival: Arrival, done: ipc.PrefillDone) -> None:
    end = time.time_ns()
    attributes = {
        "gen_ai.usage.input_tokens": done.prompt_tokens,
        "pdserve.cached_tokens": done.cached_tokens,
        "pdserve.kv_transfer.bytes": done.transfer_bytes,
    }
    server = tracer.start("pdserve.prefill", arrival.context, arrival.start_ns, server=True, attributes=attributes)
    if done.error is not None:
        tracer.fail(server, done.error)
    stages = [
        ("queue", done.queue_s),
        ("prefill", done.prefill_s),
        ("kv_destination_wait", done.destination_wait_s),
        ("kv_transfer", done.transfer_s),
    ]
    details = {
        "prefill": {"pdserve.prefill.chunks": done.prefill_chunks},
        "kv_transfer": {
            "pdserve.kv_transfer.bytes": done.transfer_bytes,
            "pdserve.kv_transfer.pages": done.transfer_pages,
            "pdserve.kv_transfer.path": done.transfer_path,
        },
    }
    at = end
    for name, seconds in reversed(stages):
        start = max(at - int(seconds * 1e9), arrival.start_ns)
        if name == "prefill" and len(done.chunk_s) > 1:
            record_chunks(tracer, server, start, at, done.chunk_s, details[name])
        else:
            tracer.span(name, server, start, at, details.get(name))
        at = start
    server.end(end_time=end)


def record_chunks(tracer: Tracer, server, start: int, end: int, chunk_s, attributes) -> None:
    """The prefill stage of a prompt computed in several batches, a `prefill_chunk` span per batch
    under it, laid out forwards from the stage's start (the last ends with the stage)."""
    stage = tracer.start("prefill", server, start, attributes=attributes)
    at = start
    for i, seconds in enumerate(chunk_s):
        until = end if i == len(chunk_s) - 1 else min(at + int(seconds * 1e9), end)
        tracer.span("prefill_chunk", stage, at, until, {"pdserve.prefill.chunk": i})
        at = until
    stage.end(end_time=end)


def record_decode(tracer: Tracer, arrival: Arrival, finished: ipc.Finished) -> None:
    end = time.time_ns()
    attributes = {
        "gen_ai.usage.input_tokens": finished.prompt_tokens,
        "gen_ai.usage.output_tokens": finished.completion_tokens,
        "gen_ai.response.finish_reasons": [finished.reason],
    }
    server = tracer.start("pdserve.decode", arrival.context, arrival.start_ns, server=True, attributes=attributes)
    t = finished.timings
    if finished.error is not None or t is None:
        tracer.fail(server, finished.error or f"ended: {finished.reason}")
        server.end(end_time=end)
        return
    if t.local_prefill:
        waits = [("queue", t.queue_s), ("prefill", t.prefill_s)]
    else:
        waits = [("queue", t.queue_s), ("kv_wait", t.kv_wait_s), ("slot_wait", t.slot_wait_s)]
    at = arrival.start_ns
    for name, seconds in waits:
        stop = min(at + int(seconds * 1e9), end)
        tracer.span(name, server, at, stop)
        at = stop
    counts = {"pdserve.decode.steps": t.steps}
    if t.spec_proposed:
        counts |= {"pdserve.speculative.proposed_tokens": t.spec_proposed}
        counts |= {"pdserve.speculative.accepted_tokens": t.spec_accepted}
    decode = tracer.start("decode_steps", server, max(end - int(t.decode_s * 1e9), at), attributes=counts)
    if finished.completion_tokens > 1:
        first = decode.start_time
        tracer.span("first_decoded_token", decode, first, first + int(t.first_token_s * 1e9))
    decode.end(end_time=end)
    server.end(end_time=end)
