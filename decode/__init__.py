"""Decode server: its engine, its event loops (loop.py), its scheduler (prealloc and transfer queues),
the gRPC service and the CLI."""
