"""The notification that rides with a prefill -> decode KV WRITE (JSON; it crosses processes).

`room` names one request's transfer on both sides; it is random so that a late notification of a
finished or aborted transfer cannot be mistaken for a live one. `pages` and `bytes` say what the
WRITE moved: the decode server acts on a notification only when they match the destination it
granted for that room (decode/engine.py), since anyone who reaches its UCX port can send one.
`heads` says which of the model's KV heads it moved (a TP server's ranks each write their own;
null: every head the receiving pool holds), so the decode server knows when a room is complete
without knowing the sender's TP size. `sum` (optional, added by the sending agent where the receiving
pool asks for it: with_checksum) is the integrity checksum of the pages moved (integrity.py).
"""

from __future__ import annotations

import json
import secrets

# 2: pages and bytes. 3: heads (and the head-major pool). 4: the token-major pool. Servers of different versions refuse
# each other's notifications: roll prefill and decode servers together (as for a KV layout change,
# docs/deploy/troubleshoot.md).
NOTIF_VERSION = 4
_ROOM_LIMIT = 1 << 63


def new_room() -> int:
    """A random 63-bit room id (fits a signed int64 anywhere it is stored)."""
    return secrets.randbits(63)


def encode_notif(
    room: int, first_token: int, logprobs: dict | None, pages: int, nbytes: int, heads: range | None = None
) -> bytes:
    """Bytes for `write_pages(..., notif=...)`: the room, the first sampled token, its logprobs,
    the page and byte counts of the WRITE and the KV heads it moved (None: all the receiver's).

    `logprobs` goes through JSON: dict keys come back as strings, tuples as lists.
    """
    if not 0 <= room < _ROOM_LIMIT:
        raise ValueError(f"room must be a 63-bit non-negative int, got {room}")
    message = {
        "v": NOTIF_VERSION,
        "room": room,
        "first_token": first_token,
        "logprobs": logprobs,
        "pages": pages,
        "bytes": nbytes,
        "heads": [heads.start, heads.stop] if heads is not None else None,
    }
    return json.dumps(message, separators=(",", ":")).encode()


_FIELDS = ("room", "first_token", "logprobs", "pages", "bytes", "heads")


def with_checksum(notif: bytes, checksum: int) -> bytes:
    """`notif` (encode_notif's bytes: one JSON object) carrying the WRITE's checksum as "sum"."""
    if not notif.endswith(b"}") or not 0 <= checksum <= 0xFFFFFFFF:
        raise ValueError(f"cannot add checksum {checksum} to {notif[:64]!r}")
    return notif[:-1] + b',"sum":%d}' % checksum


def decode_notif(data: bytes) -> dict:
    """{"room", "first_token", "logprobs", "pages", "bytes", "heads", "sum"} from `encode_notif` bytes
    ("heads" a range or None; "sum" an int, or None without one); ValueError for anything else (the
    counts and ids non-negative ints, logprobs a dict or None, heads a non-empty [start, stop) of
    non-negative ints or None, sum a 32-bit unsigned int)."""
    try:
        message = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"not a KV transfer notification: {data[:64]!r}") from error
    if not isinstance(message, dict) or message.get("v") != NOTIF_VERSION or not all(f in message for f in _FIELDS):
        raise ValueError(f"not a version-{NOTIF_VERSION} KV transfer notification: {data[:64]!r}")
    ints = [message[f] for f in ("room", "first_token", "pages", "bytes")]
    if (
        not all(type(i) is int and i >= 0 for i in ints)
        or message["room"] >= _ROOM_LIMIT
        or not isinstance(message["logprobs"], dict | None)
    ):
        raise ValueError(f"a KV transfer notification with bad fields: {data[:64]!r}")
    heads = message["heads"]
    if heads is not None:
        if not (
            isinstance(heads, list)
            and len(heads) == 2
            and all(type(h) is int for h in heads)
            and 0 <= heads[0] < heads[1]
        ):
            raise ValueError(f"a KV transfer notification with bad heads: {data[:64]!r}")
        heads = range(heads[0], heads[1])
    checksum = message.get("sum")
    if checksum is not None and not (type(checksum) is int and 0 <= checksum <= 0xFFFFFFFF):
        raise ValueError(f"a KV transfer notification with a bad checksum: {data[:64]!r}")
    return {f: message[f] for f in _FIELDS} | {"heads": heads, "sum": checksum}
