"""Decode server: prealloc/transfer queues, event_loop_overlap_disagg_decode, gRPC service, CLI (issue 5)."""
