"""What a server's failure means for the client and for the server's circuit breaker: the one map
from a gRPC status or an in-band `pb.Error.Code` to an HTTP status and to blame, used by every
router path (router/pairing.py). Never classify a failure by its message text.

HTTP status of a failed request:
    the client's fault (INVALID_REQUEST)                         400
    the server is full or draining (OVERLOADED, RESOURCE_EXHAUSTED) 429
    the request's deadline or abort (ABORTED, DEADLINE_EXCEEDED) 504
    anything else, answered by the one server that had it       502 (in-band: an upstream failed it)
    anything else, after the router tried every server it may  503 (unavailable now: retry later)
    a call that broke (any other gRPC status)                   503

Blame (a circuit breaker counts it): only evidence that the server, or the way to it, is broken.
"""

from __future__ import annotations

import grpc

from pdserve.proto import pdserve_pb2 as pb

# In-band codes whose HTTP status does not depend on who answered.
_IN_BAND = {pb.Error.INVALID_REQUEST: 400, pb.Error.OVERLOADED: 429, pb.Error.ABORTED: 504}
_RPC = {grpc.StatusCode.RESOURCE_EXHAUSTED: 429, grpc.StatusCode.DEADLINE_EXCEEDED: 504}

# The gRPC statuses that say a server (or the way to it) is broken: down, crashed, misbehaving, or
# not letting this router in. Not in it, and never blamed: CANCELLED (we cancelled: the client left,
# or a sibling choice failed), DEADLINE_EXCEEDED (the request's deadline, or the router's limit on one
# attempt: a slow server, as every server is under load; a hung one fails its health checks),
# RESOURCE_EXHAUSTED (full), and the statuses of a request the server refused as malformed.
SERVER_FAULT_STATUSES = frozenset({
    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DATA_LOSS,
    grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
})  # fmt: skip

# In-band codes that are the answering server's fault: INTERNAL (or no code), and KV_TRANSFER_FAILED
# (its side of the transfer broke). INVALID_REQUEST (the client's), OVERLOADED (full or draining),
# ABORTED (cancelled, or the request's deadline) and KV_TRANSFER_TIMEOUT (the KV did not arrive in
# time: under load a queued prefill misses the reservation) are not.
IN_BAND_FAULTS = frozenset({pb.Error.INTERNAL, pb.Error.KV_TRANSFER_FAILED, pb.Error.CODE_UNSPECIFIED})


def rpc_status(code: grpc.StatusCode) -> int:
    """The HTTP status of a request whose call ended with `code`."""
    return _RPC.get(code, 503)


def in_band_status(code, after_retries: bool) -> int:
    """The HTTP status of a request a server failed in-band with `code` (a pb.Error.Code);
    `after_retries`: the router has tried every server it may for this step (a prefill), rather than
    the one server that holds the request (its decode server)."""
    return _IN_BAND.get(code, 503 if after_retries else 502)


def server_fault(code: grpc.StatusCode) -> bool:
    """Whether a call that ended with `code` counts against the server's circuit breaker."""
    return code in SERVER_FAULT_STATUSES


def in_band_fault(code) -> bool:
    """Whether a server's in-band Error (`pb.Error.Code`) is that server's fault."""
    return code in IN_BAND_FAULTS
