"""Every thread's Python stack on demand, from a process that may be stuck.

A server's frontend, its scheduler process and its TP workers call `dump_on_signal()` first thing:
from then on `kill -USR1 <pid>` writes the stack of each of its threads to its stderr (the server's
log), and the process goes on. The dump is faulthandler's, written from the signal handler itself, so
it comes even while the interpreter is blocked in native code (a NIXL/UCX agent's start, a CUDA call,
an open() that never returns), showing the Python frame that entered it. A frontend whose scheduler
is not ready within `--startup-timeout` asks for this dump before it stops the scheduler
(common/serving/frontend.py), so a hung start says where it hung.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys

DUMP_SIGNAL = signal.SIGUSR1


def dump_on_signal() -> None:
    """From now on DUMP_SIGNAL dumps every thread's stack to stderr instead of ending the process
    (SIGUSR1's default)."""
    faulthandler.register(DUMP_SIGNAL, file=sys.stderr, all_threads=True, chain=False)


def ask_for_stacks(pid: int) -> bool:
    """Send DUMP_SIGNAL to `pid` if it has called dump_on_signal (True: its stacks are on their way
    to its stderr). NOTE never to a process that has not: SIGUSR1 would end it (a scheduler still in
    its interpreter's start), so the kernel's record of the signals it catches is read first."""
    if not _catches(pid, DUMP_SIGNAL):
        return False
    try:
        os.kill(pid, DUMP_SIGNAL)
    except ProcessLookupError:
        return False
    return True


def _catches(pid: int, sig: int) -> bool:
    """Whether `pid` has a handler for `sig`: the SigCgt mask of /proc/PID/status (Linux; elsewhere
    False, and no dump is asked for)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False
