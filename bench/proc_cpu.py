"""CPU seconds of processes, read from /proc: what `bench serve` reports per 1,000 streamed tokens
for its client and the router it measures."""

from __future__ import annotations

import os
import time


def process_cpu_s(pid: int | None) -> float | None:
    """CPU seconds (user + system, all threads) a process has used, from /proc; None where unreadable."""
    if pid is None:
        return time.process_time()
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # the name, in parentheses, may hold spaces
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def process_tree_cpu_s(pid: int) -> float | None:
    """CPU seconds a process and all its descendants have used (user + system, all threads, and
    the children each has reaped), from /proc; None where the process is gone or unreadable.

    NOTE: compare two readings (after - before). A descendant that exits between them keeps
    counting only through its parent's reaped-children time (cutime, cstime), once a process of
    the tree has waited for it; one that is not reaped by the tree (orphaned, or its parent ignores
    SIGCHLD) or still a zombie at the second reading loses its CPU from the sum, and a reap that
    races the scan may count it twice or not at all. Acceptable for a per-run figure.
    """
    ticks, children = {}, {}  # pid -> own + reaped-children ticks; pid -> its child pids
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # the name, in parentheses, may hold spaces
        except OSError:  # exited since the listing
            continue
        ticks[int(name)] = sum(int(field) for field in fields[11:15])  # utime, stime, cutime, cstime
        children.setdefault(int(fields[1]), []).append(int(name))  # ppid
    if pid not in ticks:
        return None
    total, tree = 0, [pid]
    while tree:
        member = tree.pop()
        total += ticks.get(member, 0)
        tree += children.get(member, [])
    return total / os.sysconf("SC_CLK_TCK")


def cpu_per_1k_tokens(before: float | None, after: float | None, tokens: int) -> float | None:
    if before is None or after is None or not tokens:
        return None
    return (after - before) / tokens * 1000
