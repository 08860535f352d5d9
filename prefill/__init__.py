"""Prefill server: bootstrap/inflight queues, event_loop_overlap_disagg_prefill, gRPC service, CLI (issue 5)."""
