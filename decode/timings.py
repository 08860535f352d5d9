"""Where a request's time went on the decode server (proto DecodeTimings), from the times its Req
was stamped with (common/types.py): what its Finished message carries to the router, and what the
frontend's stage histograms observe (common/serving/server_metrics.py)."""

from __future__ import annotations

from pdserve.common.serving import ipc
from pdserve.common.types import Req


def stamp_first_tokens(req: Req, now: float) -> None:
    """Called while the request's first two tokens have not all been sent: the host has seen its first
    token decoded here (its second), or, prefilled here, its first."""
    if not req.kv_landed and not req.prefilled and req.output_ids:  # (a transferred request has landed)
        req.prefilled = now
    if not req.first_decoded and len(req.output_ids) > 1:
        req.first_decoded = now


def decode_timings(req: Req, now: float) -> ipc.DecodeTimings:
    """The stages of a request finished at `now`; a stage it never reached is 0."""
    counts = dict(steps=req.sampled_steps, spec_proposed=req.spec_proposed, spec_accepted=req.spec_accepted)
    if not req.kv_landed:  # prefilled here (GenerateRequest.local_prefill)
        return ipc.DecodeTimings(
            queue_s=_span(req.arrived, req.admitted),
            prefill_s=_span(req.admitted, req.prefilled),
            first_token_s=_span(req.prefilled, req.first_decoded),
            decode_s=_span(req.prefilled, now),
            local_prefill=True,
            **counts,
        )
    return ipc.DecodeTimings(
        queue_s=_span(req.arrived, req.granted),
        kv_wait_s=_span(req.granted, req.kv_landed),
        slot_wait_s=_span(req.kv_landed, req.joined),
        first_token_s=_span(req.joined, req.first_decoded),
        decode_s=_span(req.joined, now),
        **counts,
    )


def _span(start: float, end: float) -> float:
    return max(end - start, 0.0) if start and end else 0.0
