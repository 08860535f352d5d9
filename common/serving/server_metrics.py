"""The Prometheus series a server exposes on its --metrics-port (docs/deploy/observe.md lists them):
load gauges from the scheduler's reports, and counters fed by the messages the frontend routes
(common/serving/frontend.py SchedulerBridge)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pdserve.common.serving import ipc

STAGE_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30, 60, 120, 300)

# Where requests' time went on this server, a histogram per stage (docs/deploy/observe.md): the series,
# the stage's field (prefill: of PrefillDone; decode: of its Finished message's DecodeTimings), its help.
STAGES = {
    "prefill": (
        ("pdserve_request_queue_seconds", "queue_s", "From a request's arrival to its first prefill batch."),
        ("pdserve_prefill_compute_seconds", "prefill_s", "From a request's first prefill batch to its first token."),
        (
            "pdserve_kv_destination_wait_seconds",
            "destination_wait_s",
            "From a prefilled request's first token to its KV transfer's start (its destination came later).",
        ),
    ),
    "decode": (
        (
            "pdserve_request_queue_seconds",
            "queue_s",
            "From a request's arrival to its KV destination's grant (local prefills: to their first prefill batch).",
        ),
        ("pdserve_kv_wait_seconds", "kv_wait_s", "From a KV destination's grant to the KV's arrival."),
        (
            "pdserve_prefill_compute_seconds",
            "prefill_s",
            "Local prefills: from the first prefill batch to the first token.",
        ),
        ("pdserve_decode_slot_wait_seconds", "slot_wait_s", "From the KV's arrival to joining the running batch."),
        (
            "pdserve_decode_first_token_seconds",
            "first_token_s",
            "From joining the running batch to the first token decoded here.",
        ),
        ("pdserve_decode_seconds", "decode_s", "From joining the running batch to the finish."),
    ),
}
_NOT_LOCAL = {"kv_wait_s", "slot_wait_s"}  # decode stages of a transferred request only
_NOT_TRANSFERRED = {"prefill_s"}  # and of one prefilled here only


class Metrics:
    """The Prometheus series a server exposes on its --metrics-port."""

    def __init__(self, role: str):
        self.registry = CollectorRegistry()
        r, labels = self.registry, {"role": role}

        def gauge(name, doc):
            return Gauge(name, doc, ["role"], registry=r).labels(**labels)

        self.kv_used = gauge(
            "pdserve_kv_used_tokens", "KV tokens held by requests (not counting the free or evictable cache)."
        )
        self.kv_total = gauge("pdserve_kv_total_tokens", "KV cache capacity in tokens.")
        self.running = gauge("pdserve_running_requests", "Requests in the running batch.")
        self.waiting = gauge("pdserve_waiting_requests", "Requests queued (waiting, preallocating or transferring KV).")
        self.transfer_seconds = Histogram(
            "pdserve_kv_transfer_seconds",
            "Time from the start of a request's KV WRITE to its completion.",
            ["role"],
            registry=r,
            buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30),
        ).labels(**labels)
        self.transfer_bytes = Counter(
            "pdserve_kv_transfer_bytes", "KV bytes written to decode servers.", ["role"], registry=r
        ).labels(**labels)
        # Prefill: counted as each prompt's prefill ends (PrefillDone).
        self.prompt_tokens = Counter(
            "pdserve_prefill_prompt_tokens", "Prompt tokens of the prefills this server finished.", ["role"], registry=r
        ).labels(**labels)
        self.prefix_cache_hit_tokens = Counter(
            "pdserve_prefill_cache_hit_tokens",
            "Prompt tokens of those prefills this server's prefix cache held (not computed).",
            ["role"],
            registry=r,
        ).labels(**labels)
        # Decode: counted as each destination is granted (the scheduler's Destination message).
        self.transfer_prefix_hit_tokens = Counter(
            "pdserve_kv_transfer_prefix_hit_tokens",
            "Prompt tokens whose KV a transfer did not carry: this decode server's prefix cache held them "
            "(prefix-aware transfers).",
            ["role"],
            registry=r,
        ).labels(**labels)
        # The host KV tier (--host-kv-cache-gb), from the scheduler's load reports: hit tokens, and
        # bytes and device seconds each way (their ratio is the tier's bandwidth).
        self.host_hit_tokens = Counter(
            "pdserve_host_kv_hit_tokens",
            "Prompt tokens whose KV this server copied back from its host-memory tier (not computed, not sent).",
            ["role"],
            registry=r,
        ).labels(**labels)
        self.host_copy_bytes = Counter(
            "pdserve_host_kv_copy_bytes",
            "Bytes the host KV tier copied (load: to the GPU).",
            ["role", "direction"],
            registry=r,
        )
        self.host_copy_seconds = Counter(
            "pdserve_host_kv_copy_seconds",
            "Device seconds of the host KV tier's copies (bytes / seconds: its bandwidth).",
            ["role", "direction"],
            registry=r,
        )
        backup = Counter(
            "pdserve_host_kv_backup_tokens",
            "KV tokens the host KV tier backed up as they were cached (--host-kv-write-policy write_through).",
            ["role"],
            registry=r,
        ).labels(**labels)
        evicted_without_copy = Counter(
            "pdserve_host_kv_evicted_without_copy_tokens",
            "KV tokens evicted from the GPU with no copy: their host backup was made already (write_through).",
            ["role"],
            registry=r,
        ).labels(**labels)
        tokens = {"hit": self.host_hit_tokens, "backup": backup, "evicted_without_copy": evicted_without_copy}
        self.host_tokens = {f"{key}_tokens": counter for key, counter in tokens.items()}
        self._host_seen: dict[str, float] = {}
        self.transfer_failures = Counter(
            "pdserve_kv_transfer_failures", "KV transfers that failed or timed out.", ["role"], registry=r
        ).labels(**labels)
        # Decode: notifications that matched no destination this server granted (decode/engine.py).
        self.rejected_transfers = Counter(
            "pdserve_kv_rejected_transfers",
            "KV transfer notifications refused: no such grant, or not matching it.",
            ["role", "reason"],
            registry=r,
        )
        for reason in ipc.REJECT_REASONS:  # every series exists from the start, at 0 (alerts need no absent())
            self.rejected_transfers.labels(role, reason)
        # Speculative decoding (decode servers with --speculative), from the load reports' totals, per proposer.
        self.spec_counters = {
            name: Counter(f"pdserve_{name}", doc, ["role", "proposer"], registry=r)
            for name, doc in (
                ("spec_verify_steps", "Decode steps that verified drafts (verify steps)."),
                ("spec_proposed_tokens", "Draft tokens proposed for verify steps."),
                ("spec_accepted_tokens", "Draft tokens accepted (each one a token its request gained for free)."),
                ("spec_verified_requests", "Requests given drafts in a verify step (one per request and step)."),
                ("spec_overlapped_steps", "Verify steps scheduled while the step before them ran (overlapped)."),
                (
                    "spec_unconfirmed_tokens",
                    "Drafts of overlapped verify steps dropped: they continued a guess the step before did not "
                    "confirm.",
                ),
            )
        }
        self.spec_mean_accepted_length = Gauge(
            "pdserve_spec_mean_accepted_length",
            "Tokens a request given drafts gained per verify step (1 + its accepted drafts), mean over the verify "
            "steps since the previous load report that had any.",
            ["role", "proposer"],
            registry=r,
        )
        self._spec_seen: dict[tuple[str, str], int] = {}
        self.stages = {
            field: Histogram(name, doc, ["role"], registry=r, buckets=STAGE_BUCKETS).labels(**labels)
            for name, field, doc in STAGES.get(role, ())
        }
        self.unauthenticated = Counter(
            "pdserve_unauthenticated_rpcs", "RPCs refused for a missing or wrong cluster secret.", ["role"], registry=r
        ).labels(**labels)
        self.role = role

    def update(self, load: ipc.LoadReport) -> None:
        self.kv_used.set(load.kv_used_tokens)
        self.kv_total.set(load.kv_total_tokens)
        self.running.set(load.running)
        self.waiting.set(load.waiting)
        for key, total in load.host_tier.items():  # totals: count what is new since the last report
            new, self._host_seen[key] = total - self._host_seen.get(key, 0), total
            if new <= 0:
                continue
            if key in self.host_tokens:
                self.host_tokens[key].inc(new)
            else:
                direction, unit = key.split("_")
                metric = self.host_copy_bytes if unit == "bytes" else self.host_copy_seconds
                metric.labels(self.role, direction).inc(new)
        for proposer, totals in load.speculation.items():
            self._update_speculation(proposer, totals)

    def observe_prefill(self, done: ipc.PrefillDone) -> None:
        """A prefill that succeeded: its transfer and its tokens."""
        self.prompt_tokens.inc(done.prompt_tokens)
        self.prefix_cache_hit_tokens.inc(done.cached_tokens)
        self.transfer_seconds.observe(done.transfer_s)
        self.transfer_bytes.inc(done.transfer_bytes)

    def observe_stages(self, last: ipc.PrefillDone | ipc.Finished) -> None:
        """A request that succeeded: the stages it passed (a stage it never reached is not observed)."""
        if last.error is not None:
            return
        if isinstance(last, ipc.PrefillDone):
            for field, histogram in self.stages.items():
                histogram.observe(getattr(last, field))
            return
        finished, timings = last, last.timings
        if timings is None:  # (aborted)
            return
        skip = _NOT_TRANSFERRED if not timings.local_prefill else _NOT_LOCAL
        for field, histogram in self.stages.items():
            if field in skip or (field == "first_token_s" and finished.completion_tokens < 2):
                continue
            histogram.observe(getattr(timings, field))

    def _update_speculation(self, proposer: str, totals: dict[str, int]) -> None:
        new = {}
        for name, total in totals.items():
            key = (proposer, name)
            new[name], self._spec_seen[key] = total - self._spec_seen.get(key, 0), total
            if name in self.spec_counters and new[name] > 0:
                self.spec_counters[name].labels(self.role, proposer).inc(new[name])
        if new.get("spec_verified_requests", 0) > 0:
            mean = 1 + new.get("spec_accepted_tokens", 0) / new["spec_verified_requests"]
            self.spec_mean_accepted_length.labels(self.role, proposer).set(mean)
