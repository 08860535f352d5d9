"""Timers around named calls, for `pdserve bench transfer --time-calls`: where a WRITE's host time goes
on the sending thread (the calls inside `write_pages`, each timed where it is looked up)."""

from __future__ import annotations

import statistics
import time
from collections import defaultdict


class CallTimer:
    """Wraps attributes of modules or classes with perf_counter timers (in this process only)."""

    def __init__(self):
        self.times: dict[str, list[float]] = defaultdict(list)

    def wrap(self, owner, name: str, label: str = "") -> None:
        original = getattr(owner, name)
        samples = self.times[label or name]

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                samples.append(time.perf_counter() - t0)

        setattr(owner, name, timed)

    def summary(self) -> dict[str, dict[str, float]]:
        """{label: {p50_us, mean_us, calls}} of the calls made, by label."""
        return {
            label: {
                "p50_us": statistics.median(values) * 1e6,
                "mean_us": statistics.mean(values) * 1e6,
                "calls": len(values),
            }
            for label, values in sorted(self.times.items())
            if values
        }


def time_write_calls() -> CallTimer:
    """Timers on the calls a KV WRITE makes (common/kv_transfer/): its checks, the NIXL agent's
    calls, the device copy's upload and launch."""
    from nixl._api import nixl_agent

    from pdserve.common.kv_transfer import direct, page_copy_kernel
    from pdserve.common.kv_transfer import nixl_agent as agent_module

    timer = CallTimer()
    timer.wrap(agent_module.NixlKVAgent, "write_pages", "write_pages (the whole WRITE)")
    timer.wrap(agent_module, "check_pages")
    timer.wrap(agent_module, "page_indices", "nixl: page_indices (one a side)")
    timer.wrap(nixl_agent, "make_prepped_xfer", "nixl: make_prepped_xfer")
    timer.wrap(nixl_agent, "transfer", "nixl: transfer (the post)")
    timer.wrap(nixl_agent, "check_xfer_state", "nixl: check_xfer_state")
    timer.wrap(nixl_agent, "send_notif", "send_notif (a device copy's notification)")
    timer.wrap(direct.DirectPeers, "write", "direct: DirectPeers.write")
    timer.wrap(direct, "one_run", "direct: one_run")
    timer.wrap(direct, "h2d_array", "direct: page-index upload")
    timer.wrap(page_copy_kernel, "_launch", "direct: the Triton launch")
    return timer
