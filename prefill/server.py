"""The prefill server: PrefillService (frontend process) and the prefill role (scheduler process).

Prefill(request, destination) answers once the request's KV and first token are at the decode
server named in the destination (or with an error): first token, its logprob, cached tokens,
timings. PrefillStreamed takes the request first and the destination in a later message: the
prefill runs while the router waits for the decode server's pages, and only the transfer waits.
The decode server's agent metadata travels in the destination and is cached per peer by the agent.
"""

from __future__ import annotations

import asyncio
import secrets
import time

import grpc

from pdserve.common.serving import ipc
from pdserve.common.serving.frontend import CommonRpcs, error_to_proto, logprob_to_proto, params_from_proto
from pdserve.common.serving.scheduler_process import run_scheduler
from pdserve.common.serving.server_cli import RoleLauncher
from pdserve.proto import pdserve_pb2 as pb
from pdserve.proto import pdserve_pb2_grpc as pb_grpc


class PrefillServicer(CommonRpcs, pb_grpc.PrefillServiceServicer):
    role = pb.ServerInfo.PREFILL

    async def Prefill(self, request: pb.PrefillRequest, context):
        return await self._prefill(request, None)

    async def PrefillStreamed(self, request_iterator, context):
        """The request first, its destination in a later message (or in the first)."""
        messages = request_iterator.__aiter__()
        try:
            first = await anext(messages)
        except StopAsyncIteration:
            return pb.PrefillResponse(error=pb.Error(code=pb.Error.INVALID_REQUEST, message="no request was sent"))
        return await self._prefill(first, None if first.HasField("destination") else messages)

    async def _prefill(self, request: pb.PrefillRequest, later) -> pb.PrefillResponse:
        """Run one prefill; `later`, when given, yields the message carrying the destination
        (forwarded to the scheduler as it arrives, while the prefill runs)."""
        if self.draining:
            return pb.PrefillResponse(error=pb.Error(code=pb.Error.OVERLOADED, message="the server is draining"))
        req, dest = request.request, request.destination
        rid = req.request_id or secrets.token_hex(8)
        try:
            queue = self.bridge.subscribe(rid, trace_context=req.trace_context)
        except ValueError as e:
            return pb.PrefillResponse(error=pb.Error(code=pb.Error.INVALID_REQUEST, message=str(e)))
        done = False
        forward = None
        try:
            await self.bridge.send(
                ipc.NewRequest(
                    rid,
                    list(req.prompt_token_ids),
                    params_from_proto(req.params),
                    req.bootstrap_room,
                    peer_metadata=dest.decode_agent_metadata,
                    page_ids=list(dest.page_ids),
                    expires_unix_s=dest.expires_unix_s,
                    prefix_len=dest.prefix_len,
                )
            )
            if later is not None:
                forward = asyncio.create_task(self._forward_destination(rid, later, queue))
            timeout = None
            if req.HasField("deadline_unix_s"):
                timeout = max(req.deadline_unix_s - time.time(), 0.0)
            try:
                msg = await asyncio.wait_for(queue.get(), timeout)
            except asyncio.TimeoutError:
                return pb.PrefillResponse(
                    error=pb.Error(code=pb.Error.ABORTED, message="the request's deadline passed")
                )
            done = True
            if isinstance(msg, ipc.Rejected):
                return pb.PrefillResponse(error=error_to_proto(msg.code, msg.message))
            timings = pb.Timings(
                queue_s=msg.queue_s,
                prefill_s=msg.prefill_s,
                transfer_s=msg.transfer_s,
                transfer_bytes=msg.transfer_bytes,
                destination_wait_s=msg.destination_wait_s,
            )
            response = pb.PrefillResponse(
                cached_tokens=msg.cached_tokens, prompt_tokens=msg.prompt_tokens, timings=timings
            )
            if msg.error is not None:
                response.error.CopyFrom(error_to_proto(msg.error_code, msg.error))
                return response
            if msg.first_token is not None:  # None: max_new_tokens 0, only the prompt was computed
                response.first_token_id = msg.first_token
            if msg.first_logprob is not None:
                response.first_logprob.CopyFrom(logprob_to_proto(msg.first_logprob))
            if msg.prompt_logprobs is not None:
                response.prompt_logprobs.extend(logprob_to_proto(lp) for lp in msg.prompt_logprobs)
            return response
        finally:
            if forward is not None:
                forward.cancel()
            if not done:  # cancelled by the client or past its deadline
                await self.bridge.send(ipc.Abort(rid))
            self.bridge.unsubscribe(rid)

    async def _forward_destination(self, rid: str, later, queue: asyncio.Queue) -> None:
        """Pass the first destination the client streams to the scheduler; a stream that ends
        without one fails the request (nothing else would end it before the transfer timeout)."""
        try:
            async for message in later:
                if message.HasField("destination"):
                    dest = message.destination
                    await self.bridge.send(
                        ipc.SetDestination(
                            rid, dest.decode_agent_metadata, list(dest.page_ids), dest.expires_unix_s, dest.prefix_len
                        )
                    )
                    return
        except grpc.aio.AioRpcError:
            return  # the call itself ended (cancelled): the main path answers and aborts
        await self.bridge.send(ipc.Abort(rid))
        queue.put_nowait(ipc.Rejected(rid, "the stream ended without a KV destination"))


def run_prefill_scheduler(config, server, agent_name, to_scheduler, to_frontend):
    """The scheduler process's entry point: a PrefillEngine running its event loop. (The engine, and
    torch with it, is imported only here: the frontend process never loads them.)"""

    def make_engine(startup):
        from pdserve.prefill.engine import PrefillEngine

        startup.mark("imports")
        return PrefillEngine(
            config,
            agent_name,
            server.kv_transfer_timeout,
            startup,
            server.kv_transfer_path,
            warm_grammars=not server.disable_grammar_warmup,
        )

    run_scheduler(make_engine, server, to_scheduler, to_frontend)


LAUNCHER = RoleLauncher(
    "prefill",
    PrefillServicer,
    pb_grpc.add_PrefillServiceServicer_to_server,
    "pdserve.v1.PrefillService",
    run_prefill_scheduler,
)
