"""OpenAI response bodies for /v1/completions and /v1/chat/completions, from engine Completions.

Torch-free, like openai_api.py. `completions` is always in `ParsedRequest.engine_requests()` order,
so completions[i] is choice i.
"""

from __future__ import annotations

from typing import Callable

from pdserve.common.openai.api import ParsedRequest
from pdserve.common.openai.tool_parser import finish_reason, forces_calls, parse_tool_calls, tool_names
from pdserve.common.types import Completion, TokenLogprob

# JSON has no -inf (or NaN): a token the model gave zero probability is reported with this, as vLLM does.
MIN_LOGPROB = -9999.0


def _logprob(value: float) -> float:
    return value if value >= MIN_LOGPROB else MIN_LOGPROB  # NaN fails the comparison too


def token_text_of(tokenizer) -> Callable[[int], str]:
    """Each id decoded on its own (so a byte of a multi-byte character reads as U+FFFD), cached per response."""
    cache: dict[int, str] = {}

    def text(token_id: int) -> str:
        if token_id not in cache:
            cache[token_id] = tokenizer.decode([token_id])
        return cache[token_id]

    return text


def _check_count(parsed: ParsedRequest, completions: list[Completion]) -> None:
    if len(completions) != len(parsed.params):
        raise ValueError(f"expected {len(parsed.params)} completions (one per choice), got {len(completions)}")


def usage(parsed: ParsedRequest, completions: list[Completion]) -> dict:
    """Each prompt counts once however many choices it has; every choice's output counts.

    Cached prompt tokens (OpenAI's prompt_tokens_details.cached_tokens) count once per prompt too,
    from its first choice: that is the prefill the prompt's billing stands for.
    """
    prompt_tokens = sum(len(p) for p in parsed.prompts)
    completion_tokens = sum(len(c.output_ids) for c in completions)
    cached_tokens = sum(c.cached_tokens for c in completions[:: parsed.n])
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def _token_ids(parsed: ParsedRequest, completion: Completion) -> dict:
    """vLLM's return_token_ids fields for one choice."""
    if not parsed.return_token_ids:
        return {}
    return {"prompt_token_ids": list(completion.prompt_ids), "token_ids": list(completion.output_ids)}


def _timings(parsed: ParsedRequest, completion: Completion) -> dict:
    """pdserve's "return_timings" field for one choice: where its time went (router/timings.py)."""
    if not parsed.return_timings or completion.timings is None:
        return {}
    return {"timings": completion.timings}


def vllm_prompt_logprobs(parsed: ParsedRequest, completion: Completion, token_text: Callable[[int], str]) -> dict:
    """vLLM's `prompt_logprobs` field: per prompt token (null for the first) a map from token id to
    {logprob, rank, decoded_token}, holding the prompt token and the top `prompt_logprobs`."""
    if parsed.prompt_logprobs is None:
        return {}
    k, out = parsed.prompt_logprobs, []
    for entry in completion.prompt_logprobs or [None]:
        if entry is None:
            out.append(None)
            continue
        ranked = {entry.token_id: (entry.logprob, entry.rank)}
        for rank, (token_id, lp) in enumerate(entry.top[:k], start=1):
            ranked.setdefault(token_id, (lp, rank))
        out.append(
            {
                str(t): {"logprob": _logprob(lp), "rank": r, "decoded_token": token_text(t)}
                for t, (lp, r) in ranked.items()
            }
        )
    return {"prompt_logprobs": out}


# ---- /v1/completions ----------------------------------------------------------------------------


def completion_logprobs(
    logprobs: list[TokenLogprob],
    top_n: int,
    token_text: Callable[[int], str],
    prompt: tuple[list[int], list[TokenLogprob | None]] | None = None,
) -> dict:
    """The legacy logprobs object: per token its text, logprob, the top `top_n` plus the sampled
    token (so up to top_n + 1 entries, as OpenAI documents), and its offset in the text.

    `prompt` (echo): the prompt's ids and logprobs, which lead, as OpenAI's echo does; the first
    prompt token has nothing before it, so its logprob and top are null."""
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    offset = 0
    if prompt is not None:
        ids, scored = prompt
        text = token_text(ids[0])
        tokens.append(text)
        token_logprobs.append(None)
        top_logprobs.append(None)
        text_offset.append(0)
        offset = len(text)
        logprobs = [entry for entry in scored[1:] if entry is not None] + list(logprobs)
    for entry in logprobs:
        text = token_text(entry.token_id)
        tokens.append(text)
        token_logprobs.append(_logprob(entry.logprob))
        top: dict[str, float] = {}
        # Distinct ids can decode to the same text (partial UTF-8 -> U+FFFD); the likelier one wins.
        for token_id, lp in entry.top[:top_n]:
            top.setdefault(token_text(token_id), _logprob(lp))
        top.setdefault(text, _logprob(entry.logprob))
        top_logprobs.append(top)
        text_offset.append(offset)
        offset += len(text)
    return {
        "tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": text_offset
    }  # fmt: skip


def format_completion_response(
    parsed: ParsedRequest, completions: list[Completion], tokenizer, request_id: str, created: int
) -> dict:
    """The /v1/completions body; its id is "cmpl-" + request_id."""
    _check_count(parsed, completions)
    token_text = token_text_of(tokenizer)
    choices = []
    for index, completion in enumerate(completions):
        text = completion.text
        if parsed.echo:
            text = parsed.prompt_texts[index // parsed.n] + text
        logprobs = None
        if parsed.logprobs is not None:
            prompt = (completion.prompt_ids, completion.prompt_logprobs) if parsed.echo else None
            logprobs = completion_logprobs(completion.logprobs or [], parsed.logprobs, token_text, prompt)
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": completion.finish_reason.value}
        choice |= vllm_prompt_logprobs(parsed, completion, token_text)
        choices.append(choice | _token_ids(parsed, completion) | _timings(parsed, completion))
    return {
        "id": f"cmpl-{request_id}",
        "object": "text_completion",
        "created": created,
        "model": parsed.model,
        "choices": choices,
        "usage": usage(parsed, completions),
    }


# ---- /v1/chat/completions -----------------------------------------------------------------------


def _chat_token(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": _logprob(logprob), "bytes": list(text.encode("utf-8"))}


def chat_logprobs(logprobs: list[TokenLogprob], top_n: int, token_text: Callable[[int], str]) -> dict:
    """The chat logprobs object: per token its text, logprob, UTF-8 bytes and the top `top_n`."""
    content = []
    for entry in logprobs:
        top = [_chat_token(token_text(token_id), lp) for token_id, lp in entry.top[:top_n]]
        content.append(_chat_token(token_text(entry.token_id), entry.logprob) | {"top_logprobs": top})
    return {"content": content}


def format_chat_response(
    parsed: ParsedRequest, completions: list[Completion], tokenizer, request_id: str, created: int
) -> dict:
    """The /v1/chat/completions body; its id is "chatcmpl-" + request_id."""
    _check_count(parsed, completions)
    token_text = token_text_of(tokenizer)
    tools = tool_names(parsed)
    choices = []
    for index, completion in enumerate(completions):
        logprobs = None
        if parsed.logprobs is not None:
            logprobs = chat_logprobs(completion.logprobs or [], parsed.logprobs, token_text)
        message, finish = {"role": "assistant", "content": completion.text}, completion.finish_reason.value
        if tools is not None:  # the calls out of the text (tool_parser.py); the rest is the content
            message["content"], calls = parse_tool_calls(completion.text, tools, forces_calls(parsed))
            if calls:
                message["tool_calls"] = calls
                finish = finish_reason(finish, called=True)
        choice = {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish}
        choices.append(choice | _token_ids(parsed, completion) | _timings(parsed, completion))
    body = {
        "id": f"chatcmpl-{request_id}",
        "object": "chat.completion",
        "created": created,
        "model": parsed.model,
        "choices": choices,
        "usage": usage(parsed, completions),
    }
    if completions:  # vLLM puts the (one) prompt's at the top of a chat answer
        body |= vllm_prompt_logprobs(parsed, completions[0], token_text)
    return body


def format_response(
    parsed: ParsedRequest, completions: list[Completion], tokenizer, request_id: str, created: int
) -> dict:
    """The body for either endpoint, by `parsed.kind`."""
    build = format_completion_response if parsed.kind == "completion" else format_chat_response
    return build(parsed, completions, tokenizer, request_id, created)
