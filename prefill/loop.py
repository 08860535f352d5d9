"""The prefill server's event loops (docs/architecture.md, "The overlapped loop"), as its scheduler process runs them.

Every iteration: take the frontend's requests (a prompt, maybe with its KV destination; a
destination that came later; an abort), then, inside the schedule stream: pick the next prefill
batch and launch it; in the overlapped loop the previous batch's results are processed while the
device runs this one — a prompt whose last chunk is done starts the NIXL WRITE of its KV to the
decode server (its forward has completed: the result's copy_done comes after it) — and last the
WRITEs in flight are polled: those that ended become results. Each loop yields them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

from pdserve.prefill.scheduler import PrefillResult

if TYPE_CHECKING:  # (the engine runs these loops: engine.py imports this module)
    from pdserve.prefill.engine import PrefillEngine


def event_loop_normal_disagg_prefill(prefill: PrefillEngine) -> Iterator[list[PrefillResult]]:
    """The serial twin (--disable-overlap-schedule)."""
    streams = prefill.streams
    while True:
        prefill.process_input_requests(prefill.recv_requests())
        with streams.use(streams.schedule_stream):
            batch = prefill.get_next_batch_to_run()
            if batch is not None:
                prefill.process_batch_result(batch, prefill.run_batch(batch))
            prefill.process_inflight_queue()
        yield prefill.send_outputs()


def event_loop_overlap_disagg_prefill(prefill: PrefillEngine) -> Iterator[list[PrefillResult]]:
    """Launch batch N, then process N-1 while the device runs N; then poll the WRITEs in flight."""
    schedule_stream, forward_stream = prefill.streams.schedule_stream, prefill.streams.forward_stream
    while True:
        prefill.process_input_requests(prefill.recv_requests())
        with prefill.streams.use(schedule_stream):
            batch = prefill.get_next_batch_to_run()
            if batch is not None:
                prefill.launch(batch)  # N
                # WAR barrier: the next scheduling step rewrites req_to_token rows and KV slots
                # that forward N may still be reading.
                schedule_stream.wait_stream(forward_stream)
            prefill.process_results_before(batch)  # N-1: its finished prompts start their KV WRITEs
            prefill.process_inflight_queue()  # WRITEs that ended: their results go back
        yield prefill.send_outputs()
