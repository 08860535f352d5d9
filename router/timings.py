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
    slot_wait_s         decode server: the KV's arrival to joining its running batch (it was full)
    decode_s            router: the first token to the choice's end
    total_s             router: the request's arrival to the choice's end

The first five run one after another within first_token_s (what is left of it is the network and the
hand-offs between processes), and first_token_s + decode_s = total_s. A choice the decode server
prefilled itself has its queue and prefill there, and no destination wait or transfer. After a retried
prefill or a migration, the servers' stages are those of the last attempt.
"""

from __future__ import annotations

from pdserve.router.pairing import Event, EventKind

STAGES = (
    "router_queue_s",
    "prefill_queue_s",
    "prefill_s",
    "destination_wait_s",
    "transfer_s",
    "first_token_s",
    "slot_wait_s",
    "decode_s",
    "total_s",
)


class ChoiceTimings:
    """One choice's clock: fed every event of its streams (`saw`), read once it ended (`breakdown`)."""

    def __init__(self, arrived: float, started: float):
        self.arrived, self.started = arrived, started  # time.monotonic(): the request's arrival, the choice's start
        self.first_token: float | None = None
        self.prefill = None  # the prefill's pb.Timings, from its answer
        self.decode = None  # the decode server's pb.DecodeTimings, from its finish

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
        if self.decode is not None:
            stages["slot_wait_s"] = self.decode.slot_wait_s
        stages["first_token_s"] = first - self.arrived
        stages["decode_s"] = now - first
        stages["total_s"] = now - self.arrived
        return {stage: round(max(seconds, 0.0), 6) for stage, seconds in stages.items()}


def describe(timings: dict[str, float]) -> str:
    """The log line's form, in milliseconds: "stages ms: router_queue 0.1, prefill_queue 0.3, ..., total 84.0"."""
    return "stages ms: " + ", ".join(
        f"{stage.removesuffix('_s')} {seconds * 1e3:.1f}" for stage, seconds in timings.items()
    )
