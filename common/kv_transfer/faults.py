"""Test-only fault injection in the KV transfer layer, driven by an environment variable, so the fault
tests (tests/test_transfer_faults.py) can break real transfers between real processes:

    PDSERVE_KV_FAULTS="fail_write=2,drop_notif=3"

fail_write=N: every Nth WRITE this process starts fails to post (KVTransferError, as NIXL refusing
it would); drop_notif=N: every Nth WRITE lands but carries no notification, so the receiver never
learns of it (a lost notification); corrupt_sum=N: every Nth WRITE to a pool that checks checksums
carries a wrong one (as if its bytes had changed on the way: integrity.py). Counted per agent; unset
(the default), nothing is injected and the cost is one attribute test per WRITE.
"""

from __future__ import annotations

import logging
import os

ENV = "PDSERVE_KV_FAULTS"
KINDS = ("fail_write", "drop_notif", "corrupt_sum")

logger = logging.getLogger(__name__)


class KVFaults:
    def __init__(self, spec: str):
        self.every = {kind: 0 for kind in KINDS}
        for item in filter(None, (part.strip() for part in spec.split(","))):
            kind, _, n = item.partition("=")
            if kind not in KINDS or not n.isdigit() or int(n) < 1:
                raise ValueError(f"{ENV}: {item!r} is not one of {', '.join(k + '=N' for k in KINDS)} (N >= 1)")
            self.every[kind] = int(n)
        self.writes = 0
        logger.warning("KV transfer faults injected (%s=%s): for tests only", ENV, spec)

    def next_write(self) -> str | None:
        """Count a WRITE; the fault it gets (one of KINDS) or None."""
        self.writes += 1
        for kind in KINDS:
            if self.every[kind] and self.writes % self.every[kind] == 0:
                return kind
        return None


def from_env() -> KVFaults | None:
    spec = os.environ.get(ENV, "")
    return KVFaults(spec) if spec else None
