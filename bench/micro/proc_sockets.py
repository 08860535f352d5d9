"""The TCP sockets of a port and of a process, read from /proc (Linux): which worker holds which
connection, and which connections still wait in an accept queue (bench/micro/worker_kill.py)."""

from __future__ import annotations

import os
from pathlib import Path


def tcp_sockets(port: int) -> list[tuple[str, int, str]]:
    """(TCP state, peer port, inode) of every socket on local `port` ("0A": listening,
    "01": established; inode "0": no process holds it)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            local, remote, state, inode = f[1], f[2], f[3], f[9]
            if int(local.rsplit(":", 1)[1], 16) == port:
                found.append((state, int(remote.rsplit(":", 1)[1], 16), inode))
    return found


def socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def sockets_of(pid: int, port: int) -> list[tuple[str, int]]:
    """(TCP state, peer port) of every socket `pid` holds on its local `port`."""
    inodes = socket_inodes(pid)
    return [(state, peer) for state, peer, inode in tcp_sockets(port) if inode in inodes]


def peer_ports(pid: int, port: int) -> set[int]:
    """The client ports of the connections `pid` has accepted on `port`."""
    return {peer for state, peer in sockets_of(pid, port) if state == "01"}


def unaccepted_peers(port: int) -> set[int]:
    """Client ports of connections to `port` still in a listening socket's accept queue (no process
    holds them yet: their inode is 0); the kernel has given each to one worker's queue already."""
    return {peer for state, peer, inode in tcp_sockets(port) if state == "01" and inode == "0"}


def listeners_of(pid: int, port: int) -> set[str]:
    """The inodes of `pid`'s listening sockets on `port`."""
    inodes = socket_inodes(pid)
    return {inode for state, _, inode in tcp_sockets(port) if state == "0A" and inode in inodes}


def listening(pid: int, port: int) -> bool:
    try:
        return any(state == "0A" for state, _ in sockets_of(pid, port))
    except OSError:  # not started yet, or gone
        return False
