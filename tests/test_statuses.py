"""The one map from a server's failure to the client's HTTP status and to blame (router/statuses.py),
over every in-band code and every gRPC status."""

import grpc
import pytest

from pdserve.proto import pdserve_pb2 as pb
from pdserve.router.statuses import in_band_fault, in_band_status, rpc_status, server_fault

IN_BAND = {  # code -> (status from the one server holding the request, after every retry, blamed)
    pb.Error.CODE_UNSPECIFIED: (502, 503, True),
    pb.Error.INVALID_REQUEST: (400, 400, False),
    pb.Error.OVERLOADED: (429, 429, False),
    pb.Error.KV_TRANSFER_TIMEOUT: (502, 503, False),
    pb.Error.KV_TRANSFER_FAILED: (502, 503, True),
    pb.Error.INTERNAL: (502, 503, True),
    pb.Error.ABORTED: (504, 504, False),
}

BLAMED_RPC = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.DATA_LOSS,
    grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED,
}


def test_every_in_band_code_is_in_the_table():
    assert set(IN_BAND) == set(pb.Error.Code.values())


@pytest.mark.parametrize("code", sorted(IN_BAND), ids=lambda c: pb.Error.Code.Name(c))
def test_in_band_code(code):
    alone, retried, blamed = IN_BAND[code]
    assert in_band_status(code, after_retries=False) == alone
    assert in_band_status(code, after_retries=True) == retried
    assert in_band_fault(code) is blamed


@pytest.mark.parametrize("code", list(grpc.StatusCode), ids=lambda c: c.name)
def test_rpc_status(code):
    expected = {grpc.StatusCode.RESOURCE_EXHAUSTED: 429, grpc.StatusCode.DEADLINE_EXCEEDED: 504}.get(code, 503)
    assert rpc_status(code) == expected
    assert server_fault(code) is (code in BLAMED_RPC)
