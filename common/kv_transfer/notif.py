"""The notification that rides with a prefill -> decode KV WRITE (JSON; it crosses processes).

`room` names one request's transfer on both sides; it is random so that a late notification of a
finished or aborted transfer cannot be mistaken for a live one.
"""

from __future__ import annotations

import json
import secrets

NOTIF_VERSION = 1
_ROOM_LIMIT = 1 << 63


def new_room() -> int:
    """A random 63-bit room id (fits a signed int64 anywhere it is stored)."""
    return secrets.randbits(63)


def encode_notif(room: int, first_token: int, logprobs: dict | None) -> bytes:
    """Bytes for `write_pages(..., notif=...)`: the room, the first sampled token, its logprobs.

    `logprobs` goes through JSON: dict keys come back as strings, tuples as lists.
    """
    if not 0 <= room < _ROOM_LIMIT:
        raise ValueError(f"room must be a 63-bit non-negative int, got {room}")
    message = {"v": NOTIF_VERSION, "room": room, "first_token": first_token, "logprobs": logprobs}
    return json.dumps(message, separators=(",", ":")).encode()


def decode_notif(data: bytes) -> dict:
    """{"room", "first_token", "logprobs"} from `encode_notif` bytes; ValueError if not one."""
    try:
        message = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"not a KV transfer notification: {data[:64]!r}") from error
    fields = ("room", "first_token", "logprobs")
    if not isinstance(message, dict) or message.get("v") != NOTIF_VERSION or not all(f in message for f in fields):
        raise ValueError(f"not a version-{NOTIF_VERSION} KV transfer notification: {data[:64]!r}")
    return {f: message[f] for f in fields}
