"""Picking a TCP port for a server that another process will bind.

The obvious way, bind port 0 and hand on what the kernel chose, races: the port comes from the
ephemeral range, which every process on the machine draws from for its own outgoing connections and
for listeners bound to port 0 (UCX opens several per NIXL agent). Between our close and the server's
bind, any of them can take it, and the server dies with "Address already in use" (seen in CI).

So pick below the ephemeral range, where the kernel never hands out ports by itself, check that the
port binds now, and never hand out the same port twice from one process.
"""

from __future__ import annotations

import random
import socket
import threading

_FLOOR = 10000  # stay clear of well-known service ports
_issued: set[int] = set()
_lock = threading.Lock()


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _binds(port: int, host: str) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port on `host` that is free now, outside the kernel's ephemeral range where possible."""
    low, high = _ephemeral_range()
    candidates = range(_FLOOR, low) if low - _FLOOR >= 1000 else range(high + 1, 65536)
    with _lock:
        for _ in range(200):
            port = random.choice(candidates) if len(candidates) >= 1000 else 0
            if port == 0:  # the ephemeral range covers nearly everything: let the kernel choose
                with socket.socket() as s:
                    s.bind((host, 0))
                    port = s.getsockname()[1]
            if port not in _issued and _binds(port, host):
                _issued.add(port)
                return port
    raise RuntimeError(f"no free TCP port found on {host}")
