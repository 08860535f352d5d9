"""A small asyncio HTTP/1.1 client for the serving benchmark: one connection per request, the
answer's Server-Sent Events yielded as they arrive, each stamped with the time its bytes were read.

Built on h11 (a pdserve dependency, which uvicorn needs too), because httpx and
aiohttp are not pdserve dependencies.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.parse
from typing import AsyncIterator

import h11

READ_SIZE = 1 << 16


class HTTPStatusError(Exception):
    def __init__(self, status: int, body: str):
        super().__init__(f"HTTP {status}: {body[:300]}")
        self.status = status


async def post_events(url: str, payload: dict, headers: dict[str, str]) -> AsyncIterator[tuple[float, str]]:
    """POST payload as JSON; yield (arrival time, data) for every `data:` line of the SSE answer."""
    reader, writer, conn = await _send(url, "POST", json.dumps(payload).encode(), headers)
    try:
        status, body = 0, b""
        async for stamp, event in _events(reader, conn):
            if isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                body += event.data
                if status != 200:
                    continue  # collected for the error message
                *lines, body = body.split(b"\n")  # the last piece may be an incomplete line
                for line in lines:
                    line = line.strip()
                    if line.startswith(b"data:"):
                        yield stamp, line[len(b"data:") :].strip().decode()
        if status != 200:
            raise HTTPStatusError(status, body.decode(errors="replace"))
    finally:
        writer.close()


async def get_json(url: str, headers: dict[str, str]) -> dict:
    reader, writer, conn = await _send(url, "GET", b"", headers)
    try:
        status, body = 0, b""
        async for _, event in _events(reader, conn):
            if isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                body += event.data
        if status != 200:
            raise HTTPStatusError(status, body.decode(errors="replace"))
        return json.loads(body)
    finally:
        writer.close()


async def _send(url: str, method: str, body: bytes, headers: dict[str, str]):
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"not an http(s) URL: {url!r}")
    tls = parts.scheme == "https"
    port = parts.port or (443 if tls else 80)
    reader, writer = await asyncio.open_connection(parts.hostname, port, ssl=True if tls else None)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    conn = h11.Connection(h11.CLIENT)
    head = [("Host", parts.netloc), ("Accept", "text/event-stream, application/json"), ("Connection", "close")]
    if method == "POST":
        head += [("Content-Type", "application/json"), ("Content-Length", str(len(body)))]
    head += list(headers.items())
    writer.write(conn.send(h11.Request(method=method, target=target, headers=head)))
    if body:
        writer.write(conn.send(h11.Data(data=body)))
    writer.write(conn.send(h11.EndOfMessage()))
    await writer.drain()
    return reader, writer, conn


async def _events(reader: asyncio.StreamReader, conn: h11.Connection):
    """The response's h11 events to its end, each with the time the bytes that completed it arrived."""
    stamp = time.perf_counter()
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            data = await reader.read(READ_SIZE)
            stamp = time.perf_counter()
            conn.receive_data(data)  # b"" is the end of the connection; h11 raises if it was early
            continue
        if isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
            return
        yield stamp, event
