"""Moving KV pages from a prefill pool into a decode pool (the prefill -> decode path).

This package is light on purpose: importing it does not import NIXL. The NIXL implementation is
`pdserve.common.kv_transfer.nixl_agent.NixlKVAgent`.
"""

from pdserve.common.kv_transfer.base import (
    KVLayout,
    KVTransferAgent,
    KVTransferError,
    TransferHandle,
    TransferState,
)
from pdserve.common.kv_transfer.notif import decode_notif, encode_notif, new_room

__all__ = [
    "KVLayout",
    "KVTransferAgent",
    "KVTransferError",
    "TransferHandle",
    "TransferState",
    "decode_notif",
    "encode_notif",
    "new_room",
]
