"""A child process that must not outlive its parent: a scheduler process (its server's frontend),
a TP rank (its rank 0), the MPS control daemon of `pdserve up` (router/gpu_sharing.py).

Both also poll os.getppid() in their loops, but a process blocked in native code (a collective
waiting for a peer, the NCCL start-up, a CUDA synchronize) never gets back to the loop: seen on two
H200s, where a TP server stuck at start-up kept both GPUs' memory after `pdserve up` had exited.
So the kernel kills it instead: Linux's PR_SET_PDEATHSIG (SGLang does the same). Elsewhere this
is a no-op and the polls remain.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15


def die_with_parent(parent: int) -> None:
    """SIGKILL this process when the thread that started it exits. `parent`: the pid it was
    started by; if that one is already gone (it died before this call), exit now."""
    set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(1)


def set_parent_death_signal(sig: int) -> None:
    """Have the kernel send `sig` to this process when the thread that started it exits (Linux)."""
    parent_death_signal_setter(sig)()


def parent_death_signal_setter(sig: int):
    """A function that does set_parent_death_signal(sig), with libc loaded now: safe to call in a
    child between fork and exec (Popen's preexec_fn), where loading a library could deadlock."""
    prctl = _prctl()
    return (lambda: prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)) if prctl is not None else (lambda: None)


def name_process(name: bytes) -> None:
    """Set this process's name as `ps` and `top` show it (Linux's PR_SET_NAME: 15 bytes at most; a
    no-op elsewhere). For a forked child, whose command line is its parent's."""
    prctl = _prctl()
    if prctl is not None:
        prctl(_PR_SET_NAME, ctypes.c_char_p(name[:15]), 0, 0, 0)


def _prctl():
    """libc's prctl (Linux), or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
