"""The decode server's event loops (docs/architecture.md, "The overlapped loop"), as its scheduler process runs them.

Every iteration: take the frontend's requests, then, inside the schedule stream (every device
write scheduling issues queues there, the rows of arrived KV included): publish destinations for
the requests that got pages, let the requests whose KV landed join the running batch, pick the
next batch and launch it; in the overlapped loop the previous batch's results are processed while
the device runs this one. Each loop yields, after every iteration, what it finished.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

from pdserve.common.types import Completion

if TYPE_CHECKING:  # (the engine runs these loops: engine.py imports this module)
    from pdserve.decode.engine import DecodeEngine


def event_loop_overlap_disagg_decode(decode: DecodeEngine) -> Iterator[list[Completion]]:
    """Take arrived KV into the running batch, launch batch N, then process N-1 while the device runs N."""
    schedule_stream, forward_stream = decode.streams.schedule_stream, decode.streams.forward_stream
    while True:
        decode.process_input_requests(decode.recv_requests())
        with decode.streams.use(schedule_stream):
            decode.pop_preallocated()  # pages held: the KV destinations go to the prefill servers
            decode.pop_transferred()  # KV landed: those requests join the running batch
            batch = decode.get_next_batch_to_run()
            if batch is not None:
                decode.launch(batch)  # N
                # WAR barrier: the next scheduling step rewrites req_to_token rows and KV slots
                # that forward N may still be reading.
                schedule_stream.wait_stream(forward_stream)
            decode.process_results_before(batch)  # N-1, while the device runs N
        yield decode.send_outputs()


def event_loop_normal_disagg_decode(decode: DecodeEngine) -> Iterator[list[Completion]]:
    """The serial twin (--disable-overlap-schedule)."""
    streams = decode.streams
    while True:
        decode.process_input_requests(decode.recv_requests())
        with streams.use(streams.schedule_stream):
            decode.pop_preallocated()
            decode.pop_transferred()
            batch = decode.get_next_batch_to_run()
            if batch is not None:
                decode.process_batch_result(batch, decode.run_batch(batch))
        yield decode.send_outputs()
