"""A GPU server's NIXL agent, made on a thread of its own while the model loads.

Why: making the agent (UCX's backend: its context, transports and the progress thread) took 1.2-1.3 s of
every GPU server's start-up on an H200 host, after the weights and the graphs, on the path to serving
(docs/benchmarks/startup-and-small-models.md). Nothing in it needs the KV pool: the pool is registered
with the agent afterwards (NixlKVAgent). So EngineCore starts it (`start`) once the server may touch the
GPU, and NixlKVAgent takes it (`take`) when the pool exists; an agent that failed to start raises there.

Only on CUDA. On a CPU server the agent took 0.4 s (SmolLM2, 2 cores), while both servers' loading already
kept the cores busy: a thread there was not measured to gain anything.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future

import torch

SGL_ENV = "NIXL_UCX_SGL_ENABLE"

_starting: dict[str, Future] = {}
_lock = threading.Lock()


def agent_config(device: torch.device, backend: str):
    """The agent's configuration (also NixlKVAgent's, for an agent made on the spot)."""
    from nixl._api import nixl_agent_config

    # NOTE: NIXL's progress thread busy-polls UCX: a whole core per agent, idle or not. GPU
    # agents keep it (transfers progress while the loop launches kernels; its cost on a GPU
    # node was not measured without it). DRAM agents (CPU servers: tests, laptops) run
    # without it: UCX then progresses only when this agent is polled, so whoever waits for a
    # transfer must poll both ends (the servers' loops do, every iteration, while any
    # transfer or reservation is open).
    # UCX scatter-gather: a WRITE's descriptors go to UCX as one operation, not one each
    # (docs/benchmarks/transfers.md, "UCX scatter-gather": posting a GPT-2 request's 24 descriptors fell
    # from 177 to 29 us on two H200s). NOTE: NIXL reads the variable when it makes its UCX engine, inside
    # nixl_agent(): set before it, on whichever thread. An operator's own value (0 turns it off) wins.
    os.environ.setdefault(SGL_ENV, "1")
    return nixl_agent_config(enable_prog_thread=device.type == "cuda", backends=[backend])


def start(name: str, device: torch.device | str, backend: str = "UCX") -> None:
    """Begin making agent `name` for a pool on `device` (CUDA only; once per name)."""
    device = torch.device(device)
    if device.type != "cuda":
        return
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    with _lock:
        if name in _starting:
            return
        made: Future = Future()
        _starting[name] = made

    def make() -> None:
        try:
            from nixl._api import nixl_agent

            torch.cuda.set_device(device)  # (UCX's CUDA transports look at this thread's current device)
            made.set_result(nixl_agent(name, agent_config(device, backend)))
        except BaseException as e:  # noqa: BLE001 - handed to take(), which raises it
            made.set_exception(e)

    threading.Thread(target=make, name=f"nixl-agent-{name}", daemon=True).start()


def take(name: str, timeout_s: float = 120.0):
    """The agent `start` began for `name` (waiting for it, at most `timeout_s`), or None when none was begun."""
    with _lock:
        made = _starting.pop(name, None)
    if made is None:
        return None
    try:
        return made.result(timeout=timeout_s)
    except TimeoutError:
        raise TimeoutError(f"the NIXL agent {name!r} was not made within {timeout_s:.0f} s") from None


def discard(name: str) -> None:
    """Forget the agent begun for `name`, if nothing took it (an engine whose start failed): it is
    dropped when its thread is done."""
    with _lock:
        _starting.pop(name, None)
