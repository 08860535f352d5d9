"""The decode server: DecodeService (frontend process) and the decode role (scheduler process).

Generate streams, for one request: its KV destination first (once pages are held), then token
chunks as the loop produces them, then a finish with usage — or an error. The router passes the
destination to a prefill server, whose WRITE lands in those pages.
"""

from __future__ import annotations

import asyncio
import secrets
import time

from pdserve.common import ipc
from pdserve.common.config import EngineConfig
from pdserve.common.scheduler_process import Role, sampling_params
from pdserve.common.serving import CommonRpcs, error_to_proto, layout_to_proto, params_from_proto, ready_message
from pdserve.common.types import Completion, FinishReason
from pdserve.decode.engine import DecodeEngine
from pdserve.proto import pdserve_pb2 as pb
from pdserve.proto import pdserve_pb2_grpc as pb_grpc

FINISH = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH, "abort": pb.FINISH_REASON_ABORT}


class DecodeRole(Role):
    def __init__(self, config: EngineConfig, agent_name: str, kv_transfer_timeout: float):
        self.engine = DecodeEngine(config, agent_name, kv_transfer_timeout)
        self.active: dict[str, list] = {}  # rid -> [req, tokens sent]

    def ready(self) -> ipc.Ready:
        return ready_message(self.engine)

    def on_request(self, msg: ipc.NewRequest, send) -> None:
        try:
            req = self.engine.make_req(msg.prompt_ids, sampling_params(msg.params), msg.rid)
            req.room = msg.room
            self.engine.scheduler.add_request(req)
        except ValueError as e:
            send(ipc.Rejected(msg.rid, str(e)))
            return
        self.active[msg.rid] = [req, 0]

    def on_abort(self, rid: str, send) -> None:
        completion = self.engine.abort(rid)
        if completion is not None:
            self.on_outputs([completion], send)

    def on_outputs(self, outputs: list[Completion], send) -> None:
        while self.engine.destinations:
            d = self.engine.destinations.popleft()
            send(ipc.Destination(d.rid, d.room, d.page_ids, d.expires_unix_s))
        chunks = []
        for rid, entry in self.active.items():  # stream what each request produced
            req, sent = entry
            if len(req.output_ids) > sent:
                lps = [(lp.token_id, lp.logprob, lp.top) for lp in req.output_logprobs[sent:]]
                chunks.append(ipc.Tokens(rid, sent, req.output_ids[sent:], lps))
                entry[1] = len(req.output_ids)
        if chunks:
            send(ipc.StepTokens(chunks))
        for c in outputs:
            entry = self.active.pop(c.rid, None)
            if entry is not None and len(c.output_ids) > entry[1]:
                send(ipc.Tokens(c.rid, entry[1], c.output_ids[entry[1]:]))
            send(ipc.Finished(
                c.rid, c.finish_reason.value, len(c.prompt_ids), len(c.output_ids), c.cached_tokens,
                matched_token=c.matched_stop if isinstance(c.matched_stop, int) else None,
                matched_text=c.matched_stop if isinstance(c.matched_stop, str) else None,
                error=c.error, error_code="KV_TRANSFER_TIMEOUT" if c.error and "timed out" in c.error else None,
            ))

    def load(self) -> ipc.LoadReport:
        s = self.engine.scheduler
        return ipc.LoadReport(
            running=len(s.running),
            waiting=len(s.waiting) + len(s.prealloc) + len(s.transferring),
            kv_used_tokens=s.kv_used_tokens(),
            kv_total_tokens=self.engine.runner.kv_pool.capacity_tokens,
            inflight_transfers=len(s.transferring),
        )


def run_decode_scheduler(config, agent_name, kv_transfer_timeout, log_level, to_scheduler, to_frontend):
    from pdserve.common.scheduler_process import run_scheduler

    run_scheduler(lambda: DecodeRole(config, agent_name, kv_transfer_timeout), to_scheduler, to_frontend, log_level)


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
