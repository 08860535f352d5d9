"""Large request bodies parsed in a process of the router worker's own, so that no body holds the
worker's event loop while it is parsed.

Why a process: json.loads holds the GIL for the whole call, on a thread or not (16 MiB of token ids:
~130 ms; a million-entry object: ~700 ms on the 2-core box), and turning its result into Python
objects costs as much again wherever it happens (unpickling a 350k-entry dict: ~240 ms). So the
parser process parses, then hands back a compact body: token-id prompts packed as int64 bytes
(unpacked here by one C call each), the ignored fields (`metadata`, `user`, ...) dropped once their
type is right, and at most MAX_VALUES other JSON values — a body holding more gets 413 (a JSON schema or
a conversation has hundreds or thousands; only a hostile body has more).

    parser = BodyParser()              # one per router worker; the process starts with its first body
    body = await parser.loads(raw, n)  # dict (or whatever the JSON was); OpenAIError 400/413
    parser.close()

The protocol: multiprocessing's Connection over a local socket pair (the body's bytes in; a pickle of
the compact body out: local, between a process and the child it started, never over TCP).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
from array import array
from multiprocessing.connection import Connection

from pdserve.common.lifetime import die_with_parent
from pdserve.common.openai.api import HARMLESS_FIELDS, OpenAIError

log = logging.getLogger(__name__)

MAX_VALUES = 65_536  # JSON values outside token-id prompts (unpickled here: ~45 ms at worst)
PACK_AT = 64  # token-id lists at least this long travel packed
PARSE_TIMEOUT_S = 30.0
INT64 = (-(2**63), 2**63 - 1)


class PackedIds(bytes):
    """A token-id list as int64 bytes (restored by unpack_ids)."""


def _ids(value) -> bool:
    return (
        isinstance(value, list)
        and len(value) >= PACK_AT
        and all(type(t) is int and INT64[0] <= t <= INT64[1] for t in value)
    )


def compact(body):
    """What the parser process sends back for a parsed body: see the module's docstring. Returns
    (body, values) with values the JSON values left in it."""
    if isinstance(body, dict):
        body = dict(body)
        prompt = body.get("prompt")
        if _ids(prompt):
            body["prompt"] = PackedIds(array("q", prompt).tobytes())
        elif isinstance(prompt, list) and any(_ids(p) for p in prompt):
            body["prompt"] = [PackedIds(array("q", p).tobytes()) if _ids(p) else p for p in prompt]
        for name, kind in HARMLESS_FIELDS.items():  # ignored by the parsers once their type is right
            if isinstance(body.get(name), kind):
                del body[name]
    return body, count_values(body)


def _longest_ids(body) -> int:
    """The most token ids of one token-id prompt of `body` (0 without any)."""
    prompt = body.get("prompt") if isinstance(body, dict) else None
    candidates = [prompt] + (prompt if isinstance(prompt, list) else [])
    return max((len(p) for p in candidates if _ids(p)), default=0)


def count_values(value) -> int:
    """JSON values in `value` (packed token ids count as one), stopping early past MAX_VALUES."""
    count, stack = 0, [value]
    while stack and count <= MAX_VALUES:
        item = stack.pop()
        count += 1
        if isinstance(item, dict):
            stack.extend(item.values())
            count += len(item)  # the keys
        elif isinstance(item, list):
            stack.extend(item)
    return count


async def unpack_ids(body, max_ids: int):
    """compact()'s packed prompts back as lists of ints, one prompt per turn of the event loop (a
    prompt of the most ids the model takes unpacks in ~1 ms per 16k ids); 400 for a prompt longer
    than `max_ids`, before it is unpacked."""
    if not isinstance(body, dict):
        return body
    prompt = body.get("prompt")
    if isinstance(prompt, PackedIds):
        body["prompt"] = _unpacked(prompt, max_ids)
    elif isinstance(prompt, list):
        unpacked = []
        for p in prompt:
            unpacked.append(_unpacked(p, max_ids) if isinstance(p, PackedIds) else p)
            await asyncio.sleep(0)
        body["prompt"] = unpacked
    return body


def _unpacked(packed: bytes, max_ids: int) -> list[int]:
    if len(packed) // 8 > max_ids:
        raise OpenAIError(
            f"a prompt has {len(packed) // 8} token ids: more than this model's context ({max_ids})", param="prompt"
        )
    ids = array("q")
    ids.frombytes(packed)
    return ids.tolist()


def parse(raw: bytes, max_ids: int) -> tuple:
    """The parser process's answer to one body: ("ok", body) or ("error", status, message)."""
    try:
        body = json.loads(raw)
    except ValueError as e:
        return ("error", 400, f"the request body is not valid JSON: {e}")
    except RecursionError:
        return ("error", 400, "the request body is nested too deeply")
    longest = _longest_ids(body)
    if longest > max_ids:  # refused here: no use sending it back
        return ("error", 400, f"a prompt has {longest} token ids: more than this model's context ({max_ids})")
    body, values = compact(body)
    if values > MAX_VALUES:
        return (
            "error",
            413,
            f"the request body holds more than {MAX_VALUES} JSON values besides its token-id prompts "
            "(send fewer: e.g. a prompt as token ids or text, not as many small objects)",
        )
    return ("ok", body)


def serve(conn: Connection) -> None:
    """The parser process: a body in, its answer out, until the router worker closes its end."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C at the terminal is the worker's to handle
    while True:
        try:
            max_ids = int(conn.recv_bytes())
            raw = conn.recv_bytes()
        except (EOFError, OSError):
            return
        try:
            answer = pickle.dumps(parse(raw, max_ids), protocol=pickle.HIGHEST_PROTOCOL)
        except RecursionError:  # parsed, but too deep to pickle
            answer = pickle.dumps(("error", 400, "the request body is nested too deeply"))
        except Exception as e:  # noqa: BLE001 - no body may end this process
            answer = pickle.dumps(("error", 400, f"the request body could not be parsed: {type(e).__name__}"))
        conn.send_bytes(answer)


class _Failed(Exception):
    """The parser process gave no answer (it died, or took past PARSE_TIMEOUT_S)."""


class BodyParser:
    """A router worker's parser process (started with the first body it gets), one body at a time.

    NOTE: a body's exchange with the process runs on a thread and holds the lock until that thread
    is done, even when the request that asked is cancelled meanwhile (its client went away): the
    next body must not talk over it on the same connection."""

    def __init__(self):
        self.process: subprocess.Popen | None = None
        self.conn: Connection | None = None
        self.lock = asyncio.Lock()

    def _start(self) -> None:
        self._discard()
        mine, theirs = socket.socketpair()
        # NOTE no preexec_fn: Python code between fork and exec in a process with gRPC's threads can
        # crash or hang the child; it arms its parent-death signal itself (die_with_parent).
        self.process = subprocess.Popen(
            [sys.executable, "-m", "pdserve.router.body_parser", str(theirs.fileno()), str(os.getpid())],
            pass_fds=(theirs.fileno(),),
        )
        theirs.close()
        self.conn = Connection(mine.detach())

    async def loads(self, raw: bytes, max_prompt_ids: int):
        """The body parsed (token-id prompts as lists); OpenAIError 400 (not JSON, or a token-id
        prompt longer than `max_prompt_ids`), 413 (too many values), 503 (the parser process failed
        twice: a fresh one is tried once for the same body, and started again for the next)."""
        try:
            answer = await self._ask(raw, max_prompt_ids)
        except _Failed as failed:
            log.warning("the body parser process failed (%s); a fresh one parses this body", failed)
            try:
                answer = await self._ask(raw, max_prompt_ids)
            except _Failed as again:
                raise OpenAIError(f"the request body could not be parsed here ({again})", status_code=503) from None
        if answer[0] == "error":
            raise OpenAIError(answer[2], status_code=answer[1])
        return await unpack_ids(answer[1], max_prompt_ids)

    async def _ask(self, raw: bytes, max_ids: int) -> tuple:
        """The process's answer for one body; _Failed when it could not give one."""
        await self.lock.acquire()
        try:
            if self.process is None or self.process.poll() is not None:
                self._start()
            process = self.process
            # NOTE on a thread: the 16 MiB of a large body go through the socket pair in pieces as
            # the parser process reads them (the GIL is released while the thread waits).
            exchange = asyncio.get_running_loop().run_in_executor(None, self._exchange, self.conn, raw, max_ids)
        except BaseException:
            self.lock.release()
            raise
        exchange.add_done_callback(self._exchanged)
        try:
            return await asyncio.wait_for(asyncio.shield(exchange), PARSE_TIMEOUT_S)
        except (OSError, EOFError, asyncio.TimeoutError) as e:
            if process.poll() is None:
                process.kill()  # (a timeout: the thread's read ends, and _exchanged frees the lock)
            raise _Failed(f"{type(e).__name__}, exit code {process.poll()}") from None

    @staticmethod
    def _exchange(conn: Connection, raw: bytes, max_ids: int) -> tuple:
        conn.send_bytes(str(max_ids).encode())
        conn.send_bytes(raw)
        return pickle.loads(conn.recv_bytes())

    def _exchanged(self, exchange: asyncio.Future) -> None:
        """An exchange's thread is done: a failed one leaves the process for the next body to replace."""
        if exchange.cancelled() or exchange.exception() is not None:
            self._discard()
        self.lock.release()

    def _discard(self) -> None:
        if self.process is not None:
            if self.process.poll() is None:
                self.process.kill()
            self.process.wait()
            self.process = None
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def close(self) -> None:
        self._discard()


if __name__ == "__main__":
    # NOTE: from the module by its name, not this __main__: PackedIds must pickle as
    # pdserve.router.body_parser.PackedIds, the class the worker unpickles.
    from pdserve.router.body_parser import serve as serve_bodies

    die_with_parent(int(sys.argv[2]))
    serve_bodies(Connection(int(sys.argv[1])))
    os._exit(0)
