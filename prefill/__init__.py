"""Prefill server: its engine, its event loops (loop.py), its scheduler (transfers, parked requests),
the gRPC service and the CLI."""
