"""A server's process machinery, shared by both roles: the gRPC frontend's bridge to its
scheduler process (frontend.py), the typed ipc messages between them (ipc.py), the scheduler
process that runs a role's event loop (scheduler_process.py), and the shared server flags."""
