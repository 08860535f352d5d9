"""How the router answers over HTTP, apart from what it answers (router/openai_routes.py,
router/native_routes.py): OpenAI error bodies with Retry-After, streamed answers that hold admission
slots, a request's choices run in lanes, SSE events batched per write, and requests whose client
went away.
"""

from __future__ import annotations

import asyncio
import logging

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from pdserve.common.openai.api import OpenAIError
from pdserve.router.admission import Overloaded
from pdserve.router.pairing import UpstreamError

log = logging.getLogger(__name__)


async def run_choices(choices: list, lanes: int, run_one) -> list:
    """`await run_one(index, prompt_ids, params)` for every choice, at most `lanes` at once (the
    admission slots the request holds); the results in choice order. The first exception cancels
    the choices still running and is raised."""
    results: list = [None] * len(choices)
    todo = iter(enumerate(choices))  # shared by the lanes: each takes the next choice when free

    async def lane() -> None:
        for index, (ids, params) in todo:
            results[index] = await run_one(index, ids, params)

    tasks = [asyncio.create_task(lane()) for _ in range(min(lanes, len(choices)))]
    try:
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:  # cancels both sides of every choice still running
            task.cancel()
    return results


_TASK_DONE = object()


async def queued_batches(queue: asyncio.Queue, tasks: list[asyncio.Task]):
    """What `tasks` put on `queue`, as lists of everything queued at once, until every task is done.

    Under load one HTTP write then carries several SSE events; no timer polls an idle stream.
    """
    for task in tasks:
        task.add_done_callback(lambda _: queue.put_nowait(_TASK_DONE))
    running = len(tasks)
    while running:
        items = [await queue.get()]
        while not queue.empty():
            items.append(queue.get_nowait())
        batch = [item for item in items if item is not _TASK_DONE]
        running -= len(items) - len(batch)
        if batch:
            yield batch


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready."""


async def until_disconnect(request: Request, work):
    """Await `work`, but give up (ClientGone) as soon as the client disconnects.

    The body has been read, so the next ASGI message is the disconnect: waiting for it costs
    nothing while the answer is computed (no timer polls the connection).
    """
    work = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if work in done:
        return work.result()
    work.cancel()
    raise ClientGone()


RETRY_AFTER_S = {429: "1", 503: "5"}  # what a client is told to wait before it asks again


def error_response(e: OpenAIError) -> JSONResponse:
    retry_after = RETRY_AFTER_S.get(e.status_code)
    return JSONResponse(
        e.to_body(), status_code=e.status_code, headers=None if retry_after is None else {"Retry-After": retry_after}
    )


def upstream_response(e: UpstreamError) -> JSONResponse:
    return error_response(OpenAIError(str(e), status_code=e.status))


def overloaded_response(e: Overloaded) -> JSONResponse:
    return error_response(OpenAIError(str(e), status_code=429, code="overloaded"))


class ClientStalled(Exception):
    """The client stopped reading a stream: a chunk waited past the send timeout."""


class AdmittedStream(StreamingResponse):
    """A streamed answer holding admission slots: they are handed back when the answer ends, however
    it ends. NOTE: not in the body generator's `finally`: a generator never started (the client gone
    before the first write) never runs it, and the slots would leak.

    A client that stops reading fills the socket's buffers and then the transport's (uvicorn pauses
    writing past 64 KiB); a chunk that cannot be handed over within `send_timeout` seconds drops the
    client: the body generator is closed, which cancels the request's choices on the servers (their
    KV freed), and the connection is closed without the rest of the answer."""

    def __init__(self, content, release, send_timeout: float, **kwargs):
        super().__init__(content, **kwargs)
        self.release, self.send_timeout = release, send_timeout

    async def __call__(self, scope, receive, send) -> None:
        async def send_or_drop(message) -> None:
            try:
                await asyncio.wait_for(send(message), self.send_timeout)
            except asyncio.TimeoutError:
                raise ClientStalled from None

        try:
            await super().__call__(scope, receive, send_or_drop)
        except ClientStalled:
            log.warning("a client took no streamed chunk for %g s: dropped, its request aborted", self.send_timeout)
            # NOTE: close the body now: an async generator left mid-iteration runs its `finally`
            # (which cancels the choices on the servers) only when collected, or at the loop's end.
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()
        finally:
            self.release()
