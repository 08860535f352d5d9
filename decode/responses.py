"""The decode server's answers about one request, shared by Generate (a stream per request) and
GenerateMany (every request of one caller on one stream): scheduler messages to proto messages."""

from __future__ import annotations

from pdserve.common.serving import ipc
from pdserve.common.serving.frontend import error_to_proto, layout_to_proto, params_from_proto
from pdserve.proto import pdserve_pb2 as pb

FINISH = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH, "abort": pb.FINISH_REASON_ABORT}
DEADLINE_PASSED = pb.Error(code=pb.Error.ABORTED, message="the request's deadline passed")


def new_request(rid: str, request: pb.GenerateRequest) -> ipc.NewRequest:
    return ipc.NewRequest(
        rid,
        list(request.prompt_token_ids),
        params_from_proto(request.params),
        request.bootstrap_room,
        local=request.local_prefill,
    )


def is_last(msg) -> bool:
    """Whether `msg` ends its request's stream."""
    return isinstance(msg, ipc.Finished | ipc.Rejected)


def response_of(msg, ready: ipc.Ready) -> pb.GenerateResponse:
    """The Generate message for one scheduler message about a request."""
    if isinstance(msg, ipc.Destination):
        return pb.GenerateResponse(
            destination=pb.KVDestination(
                bootstrap_room=msg.room,
                decode_agent_name=ready.agent_name,
                decode_agent_metadata=ready.agent_metadata,
                page_ids=msg.page_ids,
                layout=layout_to_proto(ready.layout),
                prefix_len=msg.prefix_len,
                expires_unix_s=msg.expires_unix_s,
            )
        )
    if isinstance(msg, ipc.Tokens):
        lps = [
            pb.TokenLogprob(token_id=t, logprob=v, top=[pb.TopLogprob(token_id=a, logprob=b) for a, b in top])
            for t, v, top in msg.logprobs
        ]
        return pb.GenerateResponse(tokens=pb.TokenChunk(token_ids=msg.token_ids, logprobs=lps, index=msg.index))
    if isinstance(msg, ipc.Rejected):
        return pb.GenerateResponse(error=error_to_proto(msg.code, msg.message))
    if msg.error:  # ipc.Finished
        return pb.GenerateResponse(error=error_to_proto(msg.error_code, msg.error))
    finish = pb.FinishInfo(
        reason=FINISH[msg.reason],
        usage=pb.Usage(
            prompt_tokens=msg.prompt_tokens, completion_tokens=msg.completion_tokens, cached_tokens=msg.cached_tokens
        ),
    )
    if msg.timings is not None:
        t = msg.timings
        finish.timings.CopyFrom(
            pb.DecodeTimings(
                queue_s=t.queue_s,
                kv_wait_s=t.kv_wait_s,
                prefill_s=t.prefill_s,
                slot_wait_s=t.slot_wait_s,
                first_token_s=t.first_token_s,
                decode_s=t.decode_s,
            )
        )
    if msg.matched_token is not None:
        finish.token_id = msg.matched_token
    elif msg.matched_text is not None:
        finish.text = msg.matched_text
    return pb.GenerateResponse(finish=finish)


def merged_tokens(first: ipc.Tokens, then: ipc.Tokens) -> ipc.Tokens | None:
    """One chunk of `first` and `then` when `then` continues it; None otherwise."""
    if then.index != first.index + len(first.token_ids):
        return None
    return ipc.Tokens(first.rid, first.index, first.token_ids + then.token_ids, first.logprobs + then.logprobs)
