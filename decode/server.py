"""The decode server: DecodeService (frontend process) and the decode role (scheduler process).

Generate streams, for one request: its KV destination first (once pages are held), then token
chunks as the loop produces them, then a finish with usage — or an error. The router passes the
destination to a prefill server, whose WRITE lands in those pages.
"""

from __future__ import annotations

import asyncio
import secrets
import time

from pdserve.common.serving import ipc
from pdserve.common.serving.frontend import CommonRpcs
from pdserve.common.serving.scheduler_process import run_scheduler
from pdserve.common.serving.server_cli import RoleLauncher
from pdserve.decode.generate_many import generate_many
from pdserve.decode.responses import DEADLINE_PASSED, is_last, merged_tokens, new_request, response_of
from pdserve.proto import pdserve_pb2 as pb
from pdserve.proto import pdserve_pb2_grpc as pb_grpc


def run_decode_scheduler(config, server, agent_name, to_scheduler, to_frontend):
    """The scheduler process's entry point: a DecodeEngine running its event loop. (The engine, and
    torch with it, is imported only here: the frontend process never loads them.)"""

    def make_engine(startup):
        from pdserve.decode.engine import DecodeEngine

        startup.mark("imports")
        return DecodeEngine(
            config,
            agent_name,
            server.kv_transfer_timeout,
            startup,
            server.kv_integrity_check,
            warm_grammars=not server.disable_grammar_warmup,
        )

    run_scheduler(make_engine, server, to_scheduler, to_frontend)


class DecodeServicer(CommonRpcs, pb_grpc.DecodeServiceServicer):
    role = pb.ServerInfo.DECODE

    async def Generate(self, request: pb.GenerateRequest, context):
        if self.draining:
            yield pb.GenerateResponse(error=pb.Error(code=pb.Error.OVERLOADED, message="the server is draining"))
            return
        rid = request.request_id or secrets.token_hex(8)
        try:
            queue = self.bridge.subscribe(rid, trace_context=request.trace_context)
        except ValueError as e:
            yield pb.GenerateResponse(error=pb.Error(code=pb.Error.INVALID_REQUEST, message=str(e)))
            return
        finished = False
        try:
            await self.bridge.send(new_request(rid, request))
            deadline = request.deadline_unix_s if request.HasField("deadline_unix_s") else None
            held = None  # a message taken from the queue while merging token chunks
            while True:
                if held is not None:
                    msg, held = held, None
                elif not queue.empty():
                    msg = queue.get_nowait()
                else:
                    timeout = None if deadline is None else max(deadline - time.time(), 0.0)
                    try:
                        msg = await asyncio.wait_for(queue.get(), timeout)
                    except asyncio.TimeoutError:
                        yield pb.GenerateResponse(error=DEADLINE_PASSED)
                        return
                if isinstance(msg, ipc.Tokens):
                    msg, held = _merge_queued_tokens(msg, queue)
                finished = is_last(msg)
                yield response_of(msg, self.ready)
                if finished:
                    return
        finally:
            # A client that went away (or a deadline) cancels the request wherever it is.
            if not finished:
                await self.bridge.send(ipc.Abort(rid))
            self.bridge.unsubscribe(rid)

    async def GenerateMany(self, request_iterator, context):
        async for response in generate_many(self, request_iterator):
            yield response


def _merge_queued_tokens(first: ipc.Tokens, queue: asyncio.Queue) -> tuple[ipc.Tokens, object]:
    """`first` with every contiguous token chunk already queued behind it, and the first other
    message taken (or None). When the stream is slower than the loop, chunks pile up here: one
    gRPC message then carries several steps' tokens instead of one message per step."""
    while not queue.empty():
        msg = queue.get_nowait()
        merged = merged_tokens(first, msg) if isinstance(msg, ipc.Tokens) else None
        if merged is None:
            return first, msg
        first = merged
    return first, None


LAUNCHER = RoleLauncher(
    "decode",
    DecodeServicer,
    pb_grpc.add_DecodeServiceServicer_to_server,
    "pdserve.v1.DecodeService",
    run_decode_scheduler,
)
