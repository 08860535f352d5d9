"""The pairing protocol (docs/architecture.md, "The disaggregated request"), one choice at a time.

    decode.Generate(request)            first message: the KV destination (pages held)
    prefill.Prefill(request, dest)      the KV and the first token land at the decode server
    decode stream                       the rest of the tokens, then the finish (or an error)

Tokens come back as ids; the router turns them into text with the same output rules the engine
uses (common/scheduling/output_processor.py), so stop strings, EOS and lengths end a choice exactly as they
would in the colocated engine.
"""

from __future__ import annotations

import asyncio
import enum
import random
import secrets
import time
from dataclasses import dataclass, field, replace

import grpc

from pdserve.common.tracing import OUTGOING_TRACE
from pdserve.common.types import SamplingParams, TokenLogprob
from pdserve.proto import pdserve_pb2 as pb
from pdserve.proto import pdserve_pb2_grpc as pb_grpc
from pdserve.router.config import RouterConfig
from pdserve.router.decode_streams import DecodeStreams
from pdserve.router.prefill_attempts import Abandoned, answer_of, watched, write_quietly
from pdserve.router.statuses import in_band_fault, in_band_status, rpc_status, server_fault

PROMPT_LOGPROBS_AT_ONCE = 256  # converted between two turns of the loop: ~2 ms (8k with 20 top each: ~80 ms)


class UpstreamError(Exception):
    """A worker failed the request; `status` is the HTTP status the client gets, `decode_failed`
    whether the decode server is to blame (for its circuit breaker; prefill failures are
    reported per attempt). Only server faults are blamed (`server_fault`, `in_band_fault`): a
    client's cancellation or deadline, an overloaded server and bad input are not the server's."""

    def __init__(self, message: str, status: int = 502, decode_failed: bool = False, reason: str = ""):
        super().__init__(message)
        self.status = status
        self.decode_failed = decode_failed
        self.reason = reason  # for counters: a decode call's status ("unavailable"), "hung" (abandoned), ...


class EventKind(str, enum.Enum):
    TOKENS = "tokens"  # new tokens of the choice (the first one as soon as prefill answers)
    FINISH = "finish"  # the choice ended


@dataclass
class Event:
    kind: EventKind
    token_ids: list[int]
    index: int = 0
    logprobs: list = field(default_factory=list)  # TokenLogprob per token, when requested
    cached_tokens: int | None = None  # on the first token: prompt tokens the prefill server had cached
    kv_transfer_bytes: int = 0  # on the first token: the KV bytes the prefill server wrote to the decode server
    # On the first token, when asked for: the prompt's logprobs (None for its first token).
    prompt_logprobs: list | None = None
    timings: object = None  # on the first token: the prefill's pb.Timings; on the finish: pb.DecodeTimings


def proto_params(p: SamplingParams) -> pb.SamplingParams:
    """The wire form of `p`. The OpenAI parser keeps every value within the wire's types; a value
    that slips past it is the request's fault (400), not a crash of the router."""
    try:
        return _proto_params(p)
    except (ValueError, TypeError) as e:  # protobuf: "Value out of range", a str that is not UTF-8
        raise UpstreamError(f"a sampling parameter does not fit the wire format: {e}", 400) from None


def _proto_params(p: SamplingParams) -> pb.SamplingParams:
    out = pb.SamplingParams(
        max_new_tokens=p.max_new_tokens,
        min_new_tokens=p.min_new_tokens,
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        min_p=p.min_p,
        repetition_penalty=p.repetition_penalty,
        frequency_penalty=p.frequency_penalty,
        presence_penalty=p.presence_penalty,
        stop=list(p.stop),
        stop_token_ids=list(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        include_stop_str_in_output=p.include_stop_str_in_output,
        skip_special_tokens=p.skip_special_tokens,
        resumed_output_tokens=p.resumed_output_tokens,
    )
    if p.seed is not None:
        out.seed = p.seed % 2**64
    if p.logprobs is not None:
        out.logprobs = p.logprobs
    if p.prompt_logprobs is not None:
        out.prompt_logprobs = p.prompt_logprobs
    out.logit_bias.extend(pb.LogitBias(token_id=t, bias=b) for t, b in p.logit_bias)
    if p.grammar is not None:
        out.grammar.kind, out.grammar.spec = p.grammar
    return out


def _request(prompt_ids: list[int], params: SamplingParams, deadline: float, local: bool = False):
    """A choice's GenerateRequest, with a fresh id and room, in the choice's trace when it is traced."""
    return pb.GenerateRequest(
        request_id=secrets.token_hex(12),
        prompt_token_ids=prompt_ids,
        params=proto_params(params),
        bootstrap_room=0 if local else random.getrandbits(63),
        deadline_unix_s=deadline,
        local_prefill=local,
        trace_context=OUTGOING_TRACE.get(),
    )


def fix_seed(p: SamplingParams) -> SamplingParams:
    """Every attempt of a request must sample the same first token: fix a seed when none was given."""
    return p if p.seed is not None else replace(p, seed=random.getrandbits(63))


def rpc_timeout(limit_s: float, deadline_unix_s: float) -> float:
    """Seconds an RPC may take: `limit_s` (0: no limit of its own), never past the request's deadline."""
    left = deadline_unix_s - time.time()
    return min(limit_s, left) if limit_s > 0 else left


def _logprob(lp: pb.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(
        lp.token_id, lp.logprob, [(t.token_id, t.logprob) for t in lp.top], lp.rank if lp.HasField("rank") else None
    )


async def prompt_logprobs_of(response: pb.PrefillResponse, params: SamplingParams) -> list | None:
    """The prompt's logprobs from a prefill's answer, None first (nothing comes before token 0);
    PROMPT_LOGPROBS_AT_ONCE at a time."""
    if params.prompt_logprobs is None:
        return None
    found, scored = [None], response.prompt_logprobs
    for start in range(0, len(scored), PROMPT_LOGPROBS_AT_ONCE):
        if start:
            await asyncio.sleep(0)
        found += map(_logprob, scored[start : start + PROMPT_LOGPROBS_AT_ONCE])
    return found


async def prefill_only(
    pick_prefill, report, prompt_ids: list[int], params: SamplingParams, config: RouterConfig
) -> pb.PrefillResponse:
    """A request for no new tokens (max_new_tokens 0: its prompt scored, say) needs no decode server:
    one prefill, with retries as any, and no KV destination; nothing is transferred."""
    req = _request(prompt_ids, params, time.time() + config.request_timeout)
    return await _prefill_with_retries(pick_prefill, report, pb.PrefillRequest(request=req), config)


def open_generate(decode, request: pb.GenerateRequest, timeout: float):
    """The decode server's stream for `request`: on the shared GenerateMany call when `decode` is
    the server's DecodeStreams, or a Generate call of its own when it is a channel."""
    if isinstance(decode, DecodeStreams):
        return decode.open(request, timeout)
    return pb_grpc.DecodeServiceStub(decode).Generate(request, timeout=timeout)


async def paired_generate(
    decode: DecodeStreams | grpc.aio.Channel,
    pick_prefill,
    report,
    prompt_ids: list[int],
    params: SamplingParams,
    config: RouterConfig,
):
    """Yields Event(TOKENS, ids, index) as they arrive (the first token as soon as prefill
    answers), then Event(FINISH). Raises UpstreamError on a worker error. Cancelling the
    consumer cancels both RPCs (the servers free the request's KV).

    `pick_prefill(tried_urls)` returns (url, channel) of a prefill server not tried yet, or None;
    `report(url, ok)` feeds the circuit breakers. The first prefill attempt starts at once, with
    the decode server's request (PrefillStreamed): the prompt is computed while the decode server
    reserves pages, and the destination follows on the same call; if that call fails, the same
    server is asked again with the unary Prefill. A prefill that fails or times out is retried on
    another prefill server with the destination: the seed is fixed, so every attempt samples the
    same first token, and the decode server takes the first transfer that lands.

    `config` gives the request's deadline (--request-timeout), the RPCs' timeouts within it and the
    number of prefill attempts.
    """
    # Both servers give up (and free the KV) past the deadline; no RPC of ours outlives it.
    deadline = time.time() + config.request_timeout
    req = _request(prompt_ids, params, deadline)
    call = open_generate(decode, req, rpc_timeout(config.decode_timeout, deadline))
    early, next_read = None, None
    try:
        target = pick_prefill([])
        if target is not None:
            url, channel = target
            timeout = rpc_timeout(config.prefill_timeout, deadline)
            early = (url, channel, pb_grpc.PrefillServiceStub(channel).PrefillStreamed(timeout=timeout))
            await write_quietly(early[2], pb.PrefillRequest(request=req))
        first = await call.read()
        if first is grpc.aio.EOF or first.WhichOneof("response") != "destination":
            raise _error(first)
        next_read = asyncio.ensure_future(call.read())
        response = await _prefill_while_decode_waits(
            next_read,
            _prefill_with_retries(
                pick_prefill, report, pb.PrefillRequest(request=req, destination=first.destination), config, early
            ),
        )
        sent = 1
        first_lp = [_logprob(response.first_logprob)] if response.HasField("first_logprob") else []
        yield Event(
            EventKind.TOKENS,
            [response.first_token_id],
            0,
            first_lp,
            cached_tokens=response.cached_tokens,
            kv_transfer_bytes=response.timings.transfer_bytes,
            timings=response.timings,
            prompt_logprobs=await prompt_logprobs_of(response, params),
        )
        # The decode stream's read started while the prefill ran; token 0 came from the prefill.
        async for event in _decode_events(call, sent, pending=next_read):
            yield event
    except grpc.aio.AioRpcError as e:  # the decode call itself broke (prefill errors are caught per attempt)
        raise _decode_call_failed(e) from e
    finally:
        if next_read is not None:
            next_read.cancel()
            if next_read.done() and not next_read.cancelled():
                next_read.exception()  # seen: the decode call broke after we stopped reading it
        call.cancel()
        if early is not None:
            early[2].cancel()  # a no-op once it answered


async def local_generate(
    decode: DecodeStreams | grpc.aio.Channel, prompt_ids: list[int], params: SamplingParams, config: RouterConfig
):
    """paired_generate's events for a choice the decode server prefills itself
    (GenerateRequest.local_prefill, router/disagg.py): no prefill server, no destination, no KV
    transfer; every token, the first included, comes on the decode stream."""
    deadline = time.time() + config.request_timeout
    req = _request(prompt_ids, params, deadline, local=True)
    call = open_generate(decode, req, rpc_timeout(config.decode_timeout, deadline))
    try:
        async for event in _decode_events(call, 0, local=True):
            yield event
    except grpc.aio.AioRpcError as e:
        raise _decode_call_failed(e) from e
    finally:
        call.cancel()


async def _decode_events(call, sent: int, pending: asyncio.Future | None = None, local: bool = False):
    """A decode stream's tokens from output index `sent` on (earlier ones, re-sent, are skipped),
    then its finish, as Events; `pending`: a read of `call` already started. `local`: the decode
    server prefilled the request itself, so its first event stands for the prefill's answer
    (cached_tokens 0) and the finish carries what its prefix cache held."""
    while True:
        if pending is not None:
            msg, pending = await pending, None
        else:
            msg = await call.read()
        if msg is grpc.aio.EOF:
            raise UpstreamError("the decode stream ended without a finish", decode_failed=True)
        kind = msg.WhichOneof("response")
        if kind == "tokens":
            chunk = msg.tokens
            skip = max(sent - chunk.index, 0)
            new = list(chunk.token_ids)[skip:]
            if new:
                cached = 0 if local and sent == 0 else None
                yield Event(
                    EventKind.TOKENS, new, sent, [_logprob(lp) for lp in chunk.logprobs[skip:]], cached_tokens=cached
                )
                sent += len(new)
        elif kind == "finish":
            cached = msg.finish.usage.cached_tokens if local else None
            yield Event(EventKind.FINISH, [], cached_tokens=cached, timings=msg.finish.timings)
            return
        else:
            raise _error(msg)


async def _prefill_while_decode_waits(decode_read: asyncio.Future, attempts) -> pb.PrefillResponse:
    """Run the prefill `attempts` while watching the decode stream. Its next message is normally
    the first token chunk, which can come before the prefill's answer (kept in `decode_read` for
    the caller). If instead the decode server fails, ends the stream or gives up (its KV transfer
    timeout), the prefill is cancelled — it frees its KV — and the decode server's failure raised:
    a prefill would only WRITE into a dead or freed reservation, fail, and be retried elsewhere,
    with the prefill servers' circuits blamed for it."""
    prefill = asyncio.ensure_future(attempts)
    try:
        done, _ = await asyncio.wait({prefill, decode_read}, return_when=asyncio.FIRST_COMPLETED)
        if prefill not in done:
            msg = decode_read.result()  # raises AioRpcError if the decode call broke
            if msg is grpc.aio.EOF:
                raise UpstreamError("the decode stream ended before the prefill answered", decode_failed=True)
            if msg.WhichOneof("response") != "tokens":
                raise _error(msg)
        return await prefill
    finally:
        prefill.cancel()  # a no-op once it answered


async def _prefill_with_retries(
    pick_prefill, report, request: pb.PrefillRequest, config: RouterConfig, early=None
) -> pb.PrefillResponse:
    """At most `config.max_prefill_attempts` prefill servers, each attempt within
    `config.prefill_timeout` and the request's deadline.

    `early`: (url, channel, PrefillStreamed call) of a first attempt already running, or None.
    An attempt on a server that stopped answering ends once its health checks say so
    (router/prefill_attempts.py), and is retried as a failed one.
    A failed attempt is reported (blamed) only when it was the server's fault; the error raised
    at the end has the HTTP status of the last failure (429 when the servers were full)."""
    tried: list[str] = []
    last, status = "no prefill server is available", 503
    retry_here = early  # (url, channel, PrefillStreamed call or None): the next attempt, if set
    dest, attempts = request.destination, 0
    while len(tried) < config.max_prefill_attempts:
        if attempts and dest.HasField("expires_unix_s") and time.time() > dest.expires_unix_s:
            # No prefill server writes into a reservation the decode server has given up.
            last = f"{last} (not retried: the decode server's KV reservation has expired)"
            break
        timeout = rpc_timeout(config.prefill_timeout, request.request.deadline_unix_s)
        if timeout <= 0:
            # Both servers have given up on the request: an attempt could only fail, and be blamed.
            last = (
                f"{last} (not retried: the request's deadline has passed)"
                if attempts
                else "the request's deadline has passed"
            )
            status = 504
            break
        if retry_here is not None:
            (url, channel, streamed), retry_here = retry_here, None
        else:
            target = pick_prefill(tried)
            if target is None:
                break
            (url, channel), streamed = target, None
        tried.append(url)
        attempts += 1
        abandoned = False
        try:
            if streamed is not None:
                answer = answer_of(streamed, request.destination)
            else:
                answer = pb_grpc.PrefillServiceStub(channel).Prefill(request, timeout=timeout)
            response = await watched(url, answer)
        except grpc.aio.AioRpcError as e:
            failure, fault, status = f"{e.code().name}: {e.details()}", server_fault(e.code()), rpc_status(e.code())
            abandoned = isinstance(e, Abandoned)
        else:
            if not response.HasField("error"):
                report(url, True)
                return response
            if response.error.code == pb.Error.INVALID_REQUEST:
                raise UpstreamError(response.error.message, 400)
            failure, fault = response.error.message, in_band_fault(response.error.code)
            status = in_band_status(response.error.code, after_retries=True)
        last = f"prefill {url}: {failure}"
        if streamed is not None and not abandoned:
            # The early attempt may fail for reasons that are not the prefill server's: no
            # PrefillStreamed (an older server), or a decode server slower to reserve pages than
            # the prefill's wait for them. Ask the same server again the plain way; that counts.
            # (Not one the router abandoned: that server stopped answering.)
            tried.pop()
            retry_here = (url, channel, None)
            continue
        if fault:
            report(url, False)
    raise UpstreamError(f"prefill failed after {attempts} attempt(s): {last}", status)


def _decode_call_failed(e: grpc.aio.AioRpcError) -> UpstreamError:
    return UpstreamError(
        f"decode server: {e.code().name}: {e.details()}",
        rpc_status(e.code()),
        decode_failed=server_fault(e.code()),
        reason="hung" if isinstance(e, Abandoned) else e.code().name.lower(),
    )


def _error(msg) -> UpstreamError:
    if msg is grpc.aio.EOF or msg.WhichOneof("response") != "error":
        return UpstreamError("the decode server answered out of protocol", decode_failed=True)
    code = msg.error.code
    return UpstreamError(
        msg.error.message, in_band_status(code, after_retries=False), decode_failed=in_band_fault(code)
    )
