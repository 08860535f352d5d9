"""One error code from the scheduler to the HTTP answer.

The names are the proto's `Error.Code` names (tests/test_proto.py keeps them in sync), so a code
crosses the ipc channel, the gRPC answer and the router unchanged; nothing classifies an error by
its message text.
"""

from __future__ import annotations

import enum


class ErrorCode(str, enum.Enum):
    INVALID_REQUEST = "INVALID_REQUEST"  # malformed, or violates a limit: the client's mistake
    OVERLOADED = "OVERLOADED"  # the server cannot take it now (draining, full): retry elsewhere
    KV_TRANSFER_TIMEOUT = "KV_TRANSFER_TIMEOUT"  # the KV did not arrive (or could not be written) in time
    KV_TRANSFER_FAILED = "KV_TRANSFER_FAILED"  # the transfer failed (backend error, peer gone)
    INTERNAL = "INTERNAL"  # a bug or an unexpected failure of the server
    ABORTED = "ABORTED"  # cancelled by the client, or its deadline passed

    @property
    def is_transfer_failure(self) -> bool:
        return self in (ErrorCode.KV_TRANSFER_TIMEOUT, ErrorCode.KV_TRANSFER_FAILED)


class StartupFailed(RuntimeError):
    """A server's scheduler process exited, or was not ready within --startup-timeout, before it
    served anything (common/serving/frontend.py): the server exits with this message, status 1."""
