"""What a newly sampled token does to a request: output ids, text, logprobs, and whether it stops.

Stop rules, checked in this order after each token:
    a grammar (structured output) terminated     -> "stop": its EOS accepted (even with ignore_eos)
    EOS (unless ignore_eos) or a stop_token_id   -> "stop"; the token is kept in output_ids but
                                                    adds no text
    a stop string in the text (after min_tokens) -> "stop"; the text is cut before it (or after,
                                                    with include_stop_str_in_output)
    max_new_tokens reached, or the context full  -> "length"
min_new_tokens is enforced at sampling time (EOS and stop ids are masked until it is reached).
"""

from __future__ import annotations

from typing import Iterator

from pdserve.common.detokenizer import find_stop_string, flush_all
from pdserve.common.errors import ErrorCode
from pdserve.common.scheduling.batch import ScheduleBatch
from pdserve.common.types import Completion, FinishReason, Req, TokenLogprob


def sampled_tokens(
    batch: ScheduleBatch, next_token_ids: list[int], logprobs: list[TokenLogprob | None]
) -> Iterator[tuple[Req, int, TokenLogprob | None]]:
    """The batch's tokens that count, with their requests: where every role's result processing
    starts (colocated and decode: common/scheduling/scheduler.py; prefill: prefill/scheduler.py).

    A mid-prompt chunk samples nothing real. Every sampled token was pending (`req.pending` counts
    the sampled-but-unseen ones); one whose request finished, was aborted or was retracted after
    the batch was launched is dropped (`req.discard`)."""
    for req, sampling, token, lp in zip(batch.reqs, batch.samples, next_token_ids, logprobs):
        if not sampling:
            continue
        req.pending -= 1
        if req.discard:
            req.discard -= 1
            continue
        yield req, token, lp


def append_token(
    req: Req, token: int, logprob: TokenLogprob | None, eos_token_ids: tuple[int, ...], context_len: int
) -> None:
    params = req.params
    req.output_ids.append(token)
    if logprob is not None:
        req.output_logprobs.append(logprob)
    if req.grammar is not None:
        if not req.grammar.accept(
            token, len(req.output_ids) - 1
        ):  # the mask allowed only what it accepts: a bug if reached
            req.finish_reason = FinishReason.ABORT
            req.error = req.grammar.failure or f"token {req.grammar.refused} is outside the request's grammar"
            req.error_code = ErrorCode.INVALID_REQUEST if req.grammar.replay_refused else ErrorCode.INTERNAL
            return
        if req.grammar.terminated:  # complete, and its stop token (EOS) accepted: nothing may follow
            req.finish_reason, req.matched_stop = FinishReason.STOP, token
            return
    if (not params.ignore_eos and token in eos_token_ids) or token in params.stop_token_ids:
        req.finish_reason, req.matched_stop = FinishReason.STOP, token
        return
    if req.detokenizer is not None and (params.stop or req.stream_text):
        _append_text(req, req.detokenizer.add(token))
        if req.finished:
            return
    if len(req.output_ids) >= params.max_new_tokens or req.seq_len >= context_len:
        req.finish_reason = FinishReason.LENGTH


def add_prompt_logprobs(batch, scored) -> None:
    """Give each request the prompt logprobs a prefill batch computed for it (host copies of
    common/engine/prompt_logprobs.PromptLogprobs, in the order of batch.prompt_logprobs)."""
    logprobs, ranks = scored.logprobs.tolist(), scored.ranks.tolist()
    top_ids = scored.top_ids.tolist() if scored.top_ids is not None else None
    top_lps = scored.top_logprobs.tolist() if scored.top_logprobs is not None else None
    row = 0
    for i, first, end in batch.prompt_logprobs:
        req = batch.reqs[i]
        n = req.params.prompt_logprobs
        for position in range(first, end):
            top = list(zip(top_ids[row][:n], top_lps[row][:n])) if n else []
            req.prompt_logprobs.append(TokenLogprob(req.prompt_ids[position + 1], logprobs[row], top, ranks[row]))
            row += 1


def _append_text(req: Req, delta: str) -> None:
    if not delta:
        return
    req.text += delta
    params = req.params
    if not params.stop or len(req.output_ids) < params.min_new_tokens:
        return
    match = find_stop_string(req.text, len(delta), params.stop)
    if match is not None:
        index, stop = match
        req.text = req.text[: index + len(stop)] if params.include_stop_str_in_output else req.text[:index]
        req.finish_reason, req.matched_stop = FinishReason.STOP, stop


def finalize(req: Req) -> Completion:
    """The request's result; flushes any text the detokenizer still held back."""
    return finalize_all([req])[0]


def finalize_all(reqs: list[Req]) -> list[Completion]:
    """The finished requests' results. The text their detokenizers still owe (all of it unless
    stop strings or streaming needed text per token) is decoded in one batch."""
    flushing = []
    for req in reqs:
        detok = req.detokenizer
        if detok is None or isinstance(req.matched_stop, str):
            continue
        # Tokens not detokenized yet, in one decode. An EOS or stop id adds no text.
        text_ids = req.output_ids[:-1] if isinstance(req.matched_stop, int) else req.output_ids
        detok.tokens += text_ids[detok.num_output() :]
        if req.finish_reason is FinishReason.ABORT:
            _append_text(req, detok.emit_ready())  # text held back for a split character is dropped
        else:
            flushing.append(req)
    for req, text in zip(flushing, flush_all([r.detokenizer for r in flushing])):
        _append_text(req, text)
    return [
        Completion(
            rid=req.rid,
            prompt_ids=req.prompt_ids,
            output_ids=req.output_ids,
            text=req.text,
            finish_reason=req.finish_reason,
            matched_stop=req.matched_stop,
            logprobs=req.output_logprobs if req.params.logprobs is not None else None,
            prompt_logprobs=req.prompt_logprobs,
            cached_tokens=req.cached_tokens,
            kv_transfer_bytes=req.kv_transfer_bytes,
            error=req.error,
            error_code=req.error_code,
        )
        for req in reqs
    ]
