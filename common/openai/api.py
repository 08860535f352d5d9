"""OpenAI request parsing and validation for /v1/completions and /v1/chat/completions.

Torch-free on purpose: the HTTP router reuses it. Every body field is either mapped onto
`SamplingParams`, checked and kept on `ParsedRequest`, listed in HARMLESS_FIELDS (checked, then
ignored), or rejected with a 400 that names it. Nothing is silently dropped.
Response building lives in `openai_format.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdserve.common.openai.defaults import GenerationDefaults
from pdserve.common.openai.fields import (  # OpenAIError: callers import it from here too
    INT32_MAX,
    MASK64,
    UINT32_MAX,
    OpenAIError,
    _boolean,
    _check_unicode,
    _integer,
    _is_int,
    _json_type,
    _logit_bias,
    _number,
    _stop,
    _stop_token_ids,
    _wrong_type,
)
from pdserve.common.openai.structured import GUIDED_FIELDS, grammar_of
from pdserve.common.types import MAX_TOP_LOGPROBS, SamplingParams

MAX_N = 128
MAX_LOGPROBS = 5  # completions' logprobs
SAMPLING_FIELDS = frozenset({
    "model", "max_tokens", "temperature", "top_p", "n", "stop", "seed", "frequency_penalty",
    "presence_penalty", "stream", "stream_options", "logit_bias",
    # vLLM / SGLang extensions
    "top_k", "min_p", "repetition_penalty", "stop_token_ids", "ignore_eos", "min_tokens",
    "skip_special_tokens", "include_stop_str_in_output", "return_token_ids", "prompt_logprobs",
    "return_timings",  # pdserve's: where each choice's time went (the router's; docs/deploy/observe.md)
    "response_format",  # (vLLM takes it on completions too)
}) | GUIDED_FIELDS  # fmt: skip
COMPLETION_FIELDS = SAMPLING_FIELDS | {"prompt", "logprobs", "echo", "best_of", "suffix"}
CHAT_FIELDS = SAMPLING_FIELDS | {
    "messages", "max_completion_tokens", "logprobs", "top_logprobs",
    "tools", "tool_choice", "parallel_tool_calls", "functions", "function_call",
}  # fmt: skip
# Accepted and ignored: they do not change what is generated.
HARMLESS_FIELDS = {"user": str, "metadata": dict, "store": bool, "service_tier": str}

CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


@dataclass
class ParsedRequest:
    """A validated request: token-id prompts and one SamplingParams per choice.

    Choices are numbered `prompt_index * n + choice`; `params` is in that order.
    """

    kind: str  # "completion" or "chat"
    model: str
    prompts: list[list[int]]
    prompt_texts: list[str]  # the prompt as text, for echo (chat: the templated conversation)
    n: int
    params: list[SamplingParams]
    logprobs: int | None = None  # None: no logprobs; k: the sampled token's plus the top k
    echo: bool = False  # with logprobs: the prompt tokens' logprobs lead the logprobs object
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs: the prompt tokens' with the top k
    return_token_ids: bool = False
    return_timings: bool = False  # each choice's stage timings in the answer (a debug field; the router's)
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage
    messages: list[dict] = field(default_factory=list)  # chat only, as given to the chat template
    # Chat only (tools.py): the validated tools ({"type": "function", "function": {...}}), None without;
    # tool_choice "none", "auto", "required" or {"type": "function", "function": {"name": ...}}.
    # Unless it is "none", calls are parsed out of the answers (tool_parser.py).
    tools: list[dict] | None = None
    tool_choice: str | dict = "none"

    def engine_requests(self) -> list[tuple[list[int], SamplingParams]]:
        """(prompt ids, params) for every choice, in choice-index order."""
        return [(self.prompts[i // self.n], params) for i, params in enumerate(self.params)]


# ---- checks shared by both endpoints ------------------------------------------------------------


def _check_fields(body: Any, accepted: frozenset | set) -> None:
    if not isinstance(body, dict):
        raise OpenAIError(f"the request body must be a JSON object, got {_json_type(body)}")
    unknown = sorted(set(body) - set(accepted) - set(HARMLESS_FIELDS))
    if unknown:
        raise OpenAIError(f"unknown field(s): {', '.join(repr(u) for u in unknown)}", param=unknown[0])
    for name, kind in HARMLESS_FIELDS.items():
        value = body.get(name)
        if value is not None and not isinstance(value, kind):
            raise _wrong_type(name, {str: "a string", dict: "an object", bool: "a boolean"}[kind], value)


def _check_model(body: dict, served_model_name: str, aliases: tuple[str, ...]) -> None:
    model = body.get("model")
    if model is None:
        return
    if not isinstance(model, str):
        raise _wrong_type("model", "a string", model)
    if model != served_model_name and model not in aliases:
        raise OpenAIError(f"The model `{model}` does not exist.", status_code=404, code="model_not_found")


def _stream_options(body: dict, allow_stream: bool) -> tuple[bool, bool]:
    """(stream, include_usage)."""
    stream = _boolean(body, "stream", False)
    if stream and not allow_stream:
        raise OpenAIError("'stream' is not supported here; it must be false or absent", param="stream")
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not stream:
        raise OpenAIError("'stream_options' is only allowed when 'stream' is true", param="stream_options")
    if not isinstance(options, dict):
        raise _wrong_type("stream_options", "an object", options)
    unknown = sorted(set(options) - {"include_usage"})
    if unknown:
        raise OpenAIError(f"unknown field(s) in 'stream_options': {', '.join(unknown)}", param="stream_options")
    return stream, _boolean(options, "include_usage", False)


def _sampling_fields(body: dict, vocab_size: int, defaults: GenerationDefaults) -> dict:
    """SamplingParams keyword arguments common to both endpoints (not max tokens, seed, logprobs);
    a field the body leaves out takes the server's default (defaults.py: the model's, or OpenAI's)."""
    return {
        "logit_bias": _logit_bias(body, vocab_size),
        "temperature": _number(body, "temperature", defaults.temperature, lambda v: 0 <= v <= 2, "between 0 and 2"),
        "top_p": _number(body, "top_p", defaults.top_p, lambda v: 0 < v <= 1, "in (0, 1]"),
        "top_k": _integer(
            body,
            "top_k",
            defaults.top_k,
            lambda v: -1 <= v <= INT32_MAX,
            f"-1 (disabled), 0 (disabled) or positive, at most {INT32_MAX}",
        ),
        "min_p": _number(body, "min_p", defaults.min_p, lambda v: 0 <= v <= 1, "in [0, 1]"),
        "repetition_penalty": _number(
            body, "repetition_penalty", defaults.repetition_penalty, lambda v: 0 < v <= 2, "in (0, 2]"
        ),
        "frequency_penalty": _number(body, "frequency_penalty", 0.0, lambda v: -2 <= v <= 2, "between -2 and 2"),
        "presence_penalty": _number(body, "presence_penalty", 0.0, lambda v: -2 <= v <= 2, "between -2 and 2"),
        "stop": _stop(body),
        "stop_token_ids": _stop_token_ids(body, vocab_size),
        "ignore_eos": _boolean(body, "ignore_eos", False),
        "min_new_tokens": _integer(
            body, "min_tokens", 0, lambda v: 0 <= v <= UINT32_MAX, f"between 0 and {UINT32_MAX}"
        ),
        "skip_special_tokens": _boolean(body, "skip_special_tokens", True),
        "include_stop_str_in_output": _boolean(body, "include_stop_str_in_output", False),
    }


def choice_seed(seed: int | None, choice: int) -> int | None:
    """The seed of choice `choice` (0..n-1) of a prompt: choice 0 keeps the client's seed, so n=1
    and n>1 agree on it; later choices get a splitmix64 mix of (seed, choice), so they differ."""
    if seed is None or choice == 0:
        return seed
    x = (seed + choice * 0x9E3779B97F4A7C15) & MASK64  # & MASK64 also maps negative seeds into range
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def _shared(
    body: Any, served_model_name: str, accepted: frozenset, allow_stream: bool, vocab_size: int,
    defaults: GenerationDefaults | None, aliases: tuple[str, ...] = (),
) -> dict:  # fmt: skip
    """The checks and values both endpoints share, keyed for _build. `defaults`: what missing
    sampling fields take (None: OpenAI's); `aliases`: other names the model answers to."""
    defaults = defaults or GenerationDefaults()
    _check_fields(body, accepted)
    _check_model(body, served_model_name, aliases)
    stream, include_usage = _stream_options(body, allow_stream)
    if stream and body.get("prompt_logprobs") is not None:  # as vLLM: they are not streamed
        raise OpenAIError("'prompt_logprobs' is not available when 'stream' is true", param="prompt_logprobs")
    return {
        "n": _integer(body, "n", 1, lambda v: 1 <= v <= MAX_N, f"between 1 and {MAX_N}"),
        "seed": _integer(body, "seed", None, lambda v: -(2**63) <= v <= MASK64, "a 64-bit integer"),
        "sampling": _sampling_fields(body, vocab_size, defaults),
        "default_max_tokens": defaults.max_tokens,
        "stream": stream,
        "include_usage": include_usage,
        "return_token_ids": _boolean(body, "return_token_ids", False),
        "return_timings": _boolean(body, "return_timings", False),
        "grammar": grammar_of(body),
        "prompt_logprobs": _integer(
            body,
            "prompt_logprobs",
            None,
            lambda v: 0 <= v <= MAX_TOP_LOGPROBS,
            f"between 0 and {MAX_TOP_LOGPROBS} (-1, the whole vocabulary, is not supported)",
        ),
    }


def _build(
    kind: str, shared: dict, model: str, prompts: list[list[int]], texts: list[str],
    max_tokens: int | None, logprobs: int | None, max_context_len: int, grammar: tuple[str, str] | None = None,
    **extra: Any,
) -> ParsedRequest:  # fmt: skip
    """One SamplingParams per (prompt, choice), after the context-length check; `grammar`
    (SamplingParams.grammar; default: the request's structured-output fields) constrains every choice."""
    n, seed = shared["n"], shared["seed"]
    grammar = grammar if grammar is not None else shared["grammar"]
    # The prompt tokens' logprobs, computed once with the largest top-k asked: for echo with
    # logprobs (the legacy object's prompt part) and for vLLM's prompt_logprobs.
    asked = [k for k in (shared["prompt_logprobs"], logprobs if extra.get("echo") else None) if k is not None]
    prompt_logprobs = max(asked) if asked else None
    prompt_word = "prompt" if kind == "completion" else "messages"
    params = []
    for prompt in prompts:
        prompt_len = len(prompt)
        if max_tokens is None and prompt_len >= max_context_len:
            raise OpenAIError(
                f"This model's maximum context length is {max_context_len} tokens. However, your request has "
                f"{prompt_len} input tokens. Please reduce the length of the {prompt_word}.",
                param=prompt_word, code="context_length_exceeded",
            )  # fmt: skip
        # vLLM's default: the rest of the context (bounded by the server's default, if it has one)
        max_new = max_tokens if max_tokens is not None else max_context_len - prompt_len
        if max_tokens is None and shared["default_max_tokens"] is not None:
            max_new = min(max_new, shared["default_max_tokens"])
        if prompt_len + max_new > max_context_len:
            raise OpenAIError(
                f"This model's maximum context length is {max_context_len} tokens. However, you requested "
                f"{prompt_len + max_new} tokens ({prompt_len} in the {prompt_word}, {max_new} in the completion). "
                f"Please reduce the length of the {prompt_word} or completion.",
                param=prompt_word, code="context_length_exceeded",
            )  # fmt: skip
        for choice in range(n):
            try:
                seed_of_choice = choice_seed(seed, choice)
                params.append(
                    SamplingParams(
                        max_new_tokens=max_new,
                        seed=seed_of_choice,
                        logprobs=logprobs,
                        prompt_logprobs=prompt_logprobs,
                        grammar=grammar,
                        **shared["sampling"],
                    )
                )
            except ValueError as e:
                raise OpenAIError(str(e)) from None
    return ParsedRequest(
        kind, model, prompts, texts, n, params, logprobs, return_token_ids=shared["return_token_ids"],
        return_timings=shared["return_timings"],
        stream=shared["stream"], include_usage=shared["include_usage"], prompt_logprobs=shared["prompt_logprobs"],
        **extra,
    )  # fmt: skip


def check_fan_out(prompts: int, n: int, max_choices: int | None, param: str) -> None:
    """A request's choices (prompts x n) against the server's limit (None: no limit), before any
    prompt is tokenized: each choice is a request on the servers."""
    if max_choices is not None and prompts * n > max_choices:
        raise OpenAIError(
            f"this request asks for {prompts * n} choices ({prompts} prompt(s) x n={n}); the limit is {max_choices} "
            f"per request (the router's --max-choices): split it into several requests",
            param=param, code="too_many_choices",
        )  # fmt: skip


def _tokenize(tokenizer, text: str, add_special_tokens: bool, param: str) -> list[int]:
    _check_unicode(text, param)
    return tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]


def _max_tokens(body: dict, name: str, least: int = 1) -> int | None:
    return _integer(body, name, None, lambda v: v >= least, f">= {least}")


# ---- /v1/completions ----------------------------------------------------------------------------


def _completion_prompts(prompt: Any, tokenizer, vocab_size: int, echo: bool) -> tuple[list[list[int]], list[str]]:
    """Token ids and text of each prompt: a string, strings, token ids, or lists of token ids (the
    text of token ids only with `echo`)."""
    if prompt is None:
        raise OpenAIError("'prompt' is required", param="prompt")
    if prompt == "" or prompt == []:
        raise OpenAIError("'prompt' must not be empty", param="prompt")
    if isinstance(prompt, str):
        prompt = [prompt]
    if not isinstance(prompt, list):
        raise _wrong_type("prompt", "a string, an array of strings or an array of token ids", prompt)
    if all(_is_int(t) for t in prompt):
        prompt = [prompt]
    if all(isinstance(p, str) for p in prompt):
        if not all(prompt):
            raise OpenAIError("'prompt' strings must not be empty", param="prompt")
        return [_tokenize(tokenizer, p, True, "prompt") for p in prompt], list(prompt)
    if not all(isinstance(p, list) and p and all(_is_int(t) for t in p) for p in prompt):
        raise OpenAIError(
            "'prompt' must be a string, an array of strings, an array of token ids or an array of "
            "non-empty arrays of token ids",
            param="prompt",
        )
    for p in prompt:
        bad = [t for t in p if not 0 <= t < vocab_size]
        if bad:
            raise OpenAIError(f"'prompt' token ids must be in [0, {vocab_size}), got {bad[:5]}", param="prompt")
    # Token-id prompts are decoded only to be echoed (a 256-token decode is a few % of a router's
    # CPU per request on a burst).
    return [list(p) for p in prompt], [tokenizer.decode(p) if echo else "" for p in prompt]


def _prompt_count(prompt: Any) -> int:
    """How many prompts `prompt` holds (a string or one token-id list is one), before any check."""
    if not isinstance(prompt, list) or all(_is_int(t) for t in prompt):
        return 1
    return len(prompt)


def parse_completion_request(
    body: dict, tokenizer, served_model_name: str, max_context_len: int, *, allow_stream: bool = False,
    max_choices: int | None = None, vocab_size: int | None = None, defaults: GenerationDefaults | None = None,
    aliases: tuple[str, ...] = (),
) -> ParsedRequest:  # fmt: skip
    """Validate a /v1/completions body and tokenize its prompts. Raises OpenAIError.

    `max_choices`: most prompts x n one request may ask for (None: no limit); `vocab_size`: token
    ids the model takes (default: the tokenizer's); `defaults`: the sampling defaults (defaults.py;
    None: OpenAI's); `aliases`: names besides `served_model_name` that `model` may give."""
    vocab_size = len(tokenizer) if vocab_size is None else vocab_size
    shared = _shared(body, served_model_name, COMPLETION_FIELDS, allow_stream, vocab_size, defaults, aliases)
    check_fan_out(_prompt_count(body.get("prompt")), shared["n"], max_choices, "prompt")
    _integer(body, "best_of", 1, lambda v: v == 1, "1 (nothing else is supported)")
    if body.get("suffix") is not None:
        raise OpenAIError("'suffix' is not supported", param="suffix")
    logprobs = _integer(body, "logprobs", None, lambda v: 0 <= v <= MAX_LOGPROBS, f"between 0 and {MAX_LOGPROBS}")
    echo = _boolean(body, "echo", False)
    # 0: only the prompt is computed (scoring it: echo with logprobs, or prompt_logprobs).
    max_tokens = _max_tokens(body, "max_tokens", least=0)
    prompts, texts = _completion_prompts(body.get("prompt"), tokenizer, vocab_size, echo)
    return _build(
        "completion", shared, served_model_name, prompts, texts, max_tokens, logprobs, max_context_len, echo=echo
    )


# ---- /v1/chat/completions -----------------------------------------------------------------------
