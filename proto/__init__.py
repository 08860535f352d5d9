"""Protocol buffers for the router <-> server gRPC services and their generated code (issue 5)."""
