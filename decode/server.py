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
from pdserve.common.serving.scheduler_process import run_scheduler
from pdserve.common.serving.server_cli import RoleLauncher
from pdserve.common.serving.frontend import CommonRpcs, error_to_proto, layout_to_proto, params_from_proto
from pdserve.proto import pdserve_pb2 as pb
from pdserve.proto import pdserve_pb2_grpc as pb_grpc

FINISH = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH, "abort": pb.FINISH_REASON_ABORT}


def run_decode_scheduler(config, server, agent_name, to_scheduler, to_frontend):
    """The scheduler process's entry point: a DecodeEngine running its event loop. (The engine, and
    torch with it, is imported only here: the frontend process never loads them.)"""
    from pdserve.decode.engine import DecodeEngine

    run_scheduler(lambda: DecodeEngine(config, agent_name, server.kv_transfer_timeout), server, to_scheduler, to_frontend)


class DecodeServicer(CommonRpcs, pb_grpc.DecodeServiceServicer):
    role = pb.ServerInfo.DECODE

    async def Generate(self, request: pb.GenerateRequest, context):
        if self.draining:
            yield pb.GenerateResponse(error=pb.Error(code=pb.Error.OVERLOADED, message="the server is draining"))
            return
        rid = request.request_id or secrets.token_hex(8)
        try:
            queue = self.bridge.subscribe(rid)
        except ValueError as e:
            yield pb.GenerateResponse(error=pb.Error(code=pb.Error.INVALID_REQUEST, message=str(e)))
            return
        finished = False
        try:
            await self.bridge.send(ipc.NewRequest(rid, list(request.prompt_token_ids), params_from_proto(request.params), request.bootstrap_room))
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
                        yield pb.GenerateResponse(error=pb.Error(code=pb.Error.ABORTED, message="the request's deadline passed"))
                        return
                if isinstance(msg, ipc.Tokens):
                    msg, held = _merge_queued_tokens(msg, queue)
                if isinstance(msg, ipc.Destination):
                    yield pb.GenerateResponse(destination=pb.KVDestination(
                        bootstrap_room=msg.room, decode_agent_name=self.ready.agent_name,
                        decode_agent_metadata=self.ready.agent_metadata, page_ids=msg.page_ids,
                        layout=layout_to_proto(self.ready.layout), expires_unix_s=msg.expires_unix_s))
                elif isinstance(msg, ipc.Tokens):
                    lps = [pb.TokenLogprob(token_id=t, logprob=v, top=[pb.TopLogprob(token_id=a, logprob=b) for a, b in top])
                           for t, v, top in msg.logprobs]
                    yield pb.GenerateResponse(tokens=pb.TokenChunk(token_ids=msg.token_ids, logprobs=lps, index=msg.index))
                elif isinstance(msg, ipc.Finished):
                    finished = True
                    if msg.error:
                        yield pb.GenerateResponse(error=error_to_proto(msg.error_code, msg.error))
                        return
                    finish = pb.FinishInfo(reason=FINISH[msg.reason], usage=pb.Usage(
                        prompt_tokens=msg.prompt_tokens, completion_tokens=msg.completion_tokens, cached_tokens=msg.cached_tokens))
                    if msg.matched_token is not None:
                        finish.token_id = msg.matched_token
                    elif msg.matched_text is not None:
                        finish.text = msg.matched_text
                    yield pb.GenerateResponse(finish=finish)
                    return
                elif isinstance(msg, ipc.Rejected):
                    finished = True
                    yield pb.GenerateResponse(error=error_to_proto(msg.code, msg.message))
                    return
        finally:
            # A client that went away (or a deadline) cancels the request wherever it is.
            if not finished:
                await self.bridge.send(ipc.Abort(rid))
            self.bridge.unsubscribe(rid)


def _merge_queued_tokens(first: ipc.Tokens, queue: asyncio.Queue) -> tuple[ipc.Tokens, object]:
    """`first` with every contiguous token chunk already queued behind it, and the first other
    message taken (or None). When the stream is slower than the loop, chunks pile up here: one
    gRPC message then carries several steps' tokens instead of one message per step."""
    token_ids, logprobs = first.token_ids, first.logprobs
    while not queue.empty():
        msg = queue.get_nowait()
        if not isinstance(msg, ipc.Tokens) or msg.index != first.index + len(token_ids):
            return ipc.Tokens(first.rid, first.index, token_ids, logprobs), msg
        token_ids = token_ids + msg.token_ids
        logprobs = logprobs + msg.logprobs
    return ipc.Tokens(first.rid, first.index, token_ids, logprobs), None


LAUNCHER = RoleLauncher("decode", DecodeServicer, pb_grpc.add_DecodeServiceServicer_to_server, "pdserve.v1.DecodeService", run_decode_scheduler)
