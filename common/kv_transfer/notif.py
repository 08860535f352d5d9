"""The notification that rides with a prefill -> decode KV WRITE (JSON; it crosses processes).

`room` names one request's transfer on both sides; it is random so that a late notification of a
finished or aborted transfer cannot be mistaken for a live one. `pages` and `bytes` say what the
WRITE moved: the decode server acts on a notification only when they match the destination it
granted for that room (decode/engine.py), since anyone who reaches its UCX port can send one.
"""

from __future__ import annotations

import json
import secrets

# 2: pages and bytes. Servers of versions 1 and 2 refuse each other's notifications: roll prefill
# and decode servers together (as for a KV layout change, docs/operations.md).
NOTIF_VERSION = 2
_ROOM_LIMIT = 1 << 63


def new_room() -> int:
    """A random 63-bit room id (fits a signed int64 anywhere it is stored)."""
    return secrets.randbits(63)


def encode_notif(room: int, first_token: int, logprobs: dict | None, pages: int, nbytes: int) -> bytes:
    """Bytes for `write_pages(..., notif=...)`: the room, the first sampled token, its logprobs,
    and the page and byte counts of the WRITE.

    `logprobs` goes through JSON: dict keys come back as strings, tuples as lists.
    """
    if not 0 <= room < _ROOM_LIMIT:
        raise ValueError(f"room must be a 63-bit non-negative int, got {room}")
    message = {"v": NOTIF_VERSION, "room": room, "first_token": first_token, "logprobs": logprobs,
               "pages": pages, "bytes": nbytes}
    return json.dumps(message, separators=(",", ":")).encode()


_FIELDS = ("room", "first_token", "logprobs", "pages", "bytes")


def decode_notif(data: bytes) -> dict:
    """{"room", "first_token", "logprobs", "pages", "bytes"} from `encode_notif` bytes; ValueError
    for anything else (the counts and ids non-negative ints, logprobs a dict or None)."""
    try:
        message = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"not a KV transfer notification: {data[:64]!r}") from error
    if not isinstance(message, dict) or message.get("v") != NOTIF_VERSION or not all(f in message for f in _FIELDS):
        raise ValueError(f"not a version-{NOTIF_VERSION} KV transfer notification: {data[:64]!r}")
    ints = [message[f] for f in ("room", "first_token", "pages", "bytes")]
    if not all(type(i) is int and i >= 0 for i in ints) or message["room"] >= _ROOM_LIMIT \
            or not isinstance(message["logprobs"], dict | None):
        raise ValueError(f"a KV transfer notification with bad fields: {data[:64]!r}")
    return {f: message[f] for f in _FIELDS}
