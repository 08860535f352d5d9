"""OpenAI request parsing/validation and response building, on a tiny real byte-level BPE tokenizer."""

import json
import subprocess
import sys

import pytest

from pdserve.common.openai.api import (
    OpenAIError,
    choice_seed,
    parse_completion_request,
)
from pdserve.common.openai.chat import parse_chat_request
from pdserve.common.openai.format import (
    MIN_LOGPROB,
    format_chat_response,
    format_completion_response,
)
from pdserve.common.types import Completion, FinishReason, SamplingParams, TokenLogprob

MODEL = "tiny"
CONTEXT = 128
SPECIALS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = ["hello world, the quick brown fox jumps over the lazy dog"] * 10 + ["Once upon a time, a tiny model"]


def build_tokenizer():
    """A byte-level BPE tokenizer that prepends <|bos|>, with a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    bos = tok.token_to_id("<|bos|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", pair="<|bos|> $A <|bos|> $B", special_tokens=[("<|bos|>", bos)]
    )
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>")
    hf.chat_template = CHATML
    return hf


def fake_completions(tokenizer, prompts, params) -> list[Completion]:
    """A deterministic stand-in for the engine: letters picked from (prompt, seed), at most 3 + len % 3."""
    letters = tokenizer.convert_tokens_to_ids(list("abcdefghijklmnopqrstuvwxyz"))
    results = []
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        length = min(p.max_new_tokens, 3 + len(prompt) % 3)
        start = sum(prompt) + (p.seed or 0) % 1000
        out = [letters[(start + 7 * k) % 26] for k in range(length)]
        logprobs = None
        if p.logprobs is not None:
            logprobs = [
                TokenLogprob(t, -0.25 * (k + 1), top=[(letters[j], -0.125 * (j + 1)) for j in range(p.logprobs)])
                for k, t in enumerate(out)
            ]
        reason = FinishReason.LENGTH if length == p.max_new_tokens else FinishReason.STOP
        results.append(
            Completion(f"r{i}", list(prompt), out, tokenizer.decode(out), reason, logprobs=logprobs, cached_tokens=i)
        )
    return results


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def parse_completion(tokenizer, **body):
    return parse_completion_request(body, tokenizer, MODEL, CONTEXT)


def parse_chat(tokenizer, **body):
    return parse_chat_request(body, tokenizer, MODEL, CONTEXT)


USER = [{"role": "user", "content": "hello"}]
LONG = "the quick brown fox " * 60

# (body, expected status, substring of the message)
BAD_COMPLETIONS = [
    ({"prompt": "hi", "temperature": "hot"}, 400, "'temperature' must be a number, got string"),
    ({"prompt": "hi", "temperature": 2.5}, 400, "'temperature' must be between 0 and 2"),
    ({"prompt": "hi", "temperature": float("nan")}, 400, "finite"),
    ({"prompt": "hi", "top_p": 0}, 400, "'top_p' must be in (0, 1]"),
    ({"prompt": "hi", "top_p": 1.5}, 400, "'top_p'"),
    ({"prompt": "hi", "max_tokens": -3}, 400, "'max_tokens' must be >= 0"),
    ({"prompt": "hi", "prompt_logprobs": -1}, 400, "-1, the whole vocabulary, is not supported"),
    ({"prompt": "hi", "prompt_logprobs": 21}, 400, "'prompt_logprobs' must be between 0 and 20"),
    ({"prompt": "hi", "max_tokens": 4.0}, 400, "'max_tokens' must be an integer, got number"),
    ({"prompt": "hi", "max_tokens": True}, 400, "'max_tokens' must be an integer, got boolean"),
    ({"prompt": "hi", "max_tokens": 10**9}, 400, "maximum context length is 128 tokens"),
    ({"prompt": LONG}, 400, "maximum context length is 128 tokens"),
    ({"prompt": "hi", "n": 0}, 400, "'n' must be between 1 and 128"),
    ({"prompt": "hi", "n": 129}, 400, "'n' must be between 1 and 128"),
    ({"prompt": "hi", "logprobs": 6}, 400, "'logprobs' must be between 0 and 5"),
    ({"prompt": "hi", "logprobs": True}, 400, "'logprobs' must be an integer, got boolean"),
    ({"prompt": "hi", "stream": True}, 400, "'stream'"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "'stream_options'"),
    ({"prompt": "hi", "best_of": 2}, 400, "'best_of' must be 1"),
    ({"prompt": "hi", "best_of": True}, 400, "'best_of' must be an integer"),
    ({"prompt": "a\ud800b"}, 400, "'prompt' is not valid Unicode"),
    ({"prompt": "hi", "suffix": "x"}, 400, "'suffix'"),
    ({"prompt": "hi", "logit_bias": {"x": 1}}, 400, "'logit_bias' keys must be token ids"),
    ({"prompt": "hi", "logit_bias": {"5": 101}}, 400, "'logit_bias' values must be numbers in [-100, 100]"),
    ({"prompt": "hi", "logit_bias": {"5": True}}, 400, "'logit_bias' values must be numbers"),
    ({"prompt": "hi", "logit_bias": [5]}, 400, "'logit_bias' must be an object"),
    ({"prompt": "hi", "logit_bias": {"99999999": 1}}, 400, "'logit_bias' keys must be token ids"),
    ({"prompt": "hi", "frequency_penalty": 3}, 400, "'frequency_penalty' must be between -2 and 2"),
    ({"prompt": "hi", "seed": 2**64}, 400, "'seed' must be a 64-bit integer"),
    ({"prompt": "hi", "seed": "7"}, 400, "'seed' must be an integer, got string"),
    ({"prompt": "hi", "stop": 5}, 400, "'stop' must be a string or an array of strings"),
    ({"prompt": "hi", "stop": [""]}, 400, "'stop' strings must not be empty"),
    ({"prompt": "hi", "stop_token_ids": [-1]}, 400, "'stop_token_ids'"),
    ({"prompt": "hi", "min_tokens": 9, "max_tokens": 4}, 400, "min_tokens"),
    ({"prompt": "hi", "top_k": -2}, 400, "'top_k'"),
    ({"prompt": "hi", "user": 5}, 400, "'user' must be a string"),
    ({"prompt": "hi", "frobnicate": 1, "zap": 2}, 400, "unknown field(s): 'frobnicate', 'zap'"),
    ({"prompt": "hi", "messages": USER}, 400, "unknown field(s): 'messages'"),
    ({"prompt": "hi", "model": "gpt-4"}, 404, "The model `gpt-4` does not exist."),
    ({"prompt": "hi", "model": 3}, 400, "'model' must be a string"),
    ({}, 400, "'prompt' is required"),
    ({"prompt": ""}, 400, "'prompt' must not be empty"),
    ({"prompt": []}, 400, "'prompt' must not be empty"),
    ({"prompt": ["a", ""]}, 400, "must not be empty"),
    ({"prompt": [[1, 2], []]}, 400, "non-empty arrays of token ids"),
    ({"prompt": [1, "a"]}, 400, "'prompt' must be"),
    ({"prompt": {"text": "hi"}}, 400, "'prompt' must be a string"),
    ({"prompt": [1, 2, 100000]}, 400, "token ids must be in [0, "),
    ({"prompt": [[1], [-1]]}, 400, "token ids must be in [0, "),
    # past the wire's types (proto/pdserve.proto) or the model: a 400 here, never a 500 later
    ({"prompt": "hi", "stop_token_ids": [10**12]}, 400, "'stop_token_ids' must be token ids in [0, "),
    ({"prompt": "hi", "stop_token_ids": [1] * 1025}, 400, "'stop_token_ids' takes at most 1024 ids"),
    ({"prompt": "hi", "top_k": 2**31}, 400, "'top_k' must be"),
    ({"prompt": "hi", "min_tokens": 2**32}, 400, "'min_tokens' must be between 0 and 4294967295"),
    ({"prompt": "hi", "stop": ["s"] * 65}, 400, "'stop' takes at most 64 strings"),
    ({"prompt": "hi", "stop": ["x" * 1025]}, 400, "of at most 1024 characters"),
    ({"prompt": "hi", "stop": "a\ud800"}, 400, "'stop' is not valid Unicode"),
]

BAD_CHATS = [
    ({}, 400, "'messages' is required"),
    ({"messages": []}, 400, "'messages' must not be empty"),
    ({"messages": "hello"}, 400, "'messages' must be an array, got string"),
    ({"messages": [{"role": "robot", "content": "x"}]}, 400, "'messages[0].role' must be one of"),
    ({"messages": [{"role": {}, "content": "x"}]}, 400, "'messages[0].role' must be one of"),
    ({"messages": [{"role": ["user"], "content": "x"}]}, 400, "'messages[0].role' must be one of"),
    ({"messages": USER + [{"role": "tool", "content": "x"}]}, 400, "'messages[1].tool_call_id' must be a string"),
    ({"messages": USER + [{"role": "user"}]}, 400, "'messages[1].content' is required"),
    ({"messages": [{"role": "user", "content": 5}]}, 400, "'messages[0].content' must be a string"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, 400, "only text"),
    (
        {"messages": [{"role": "user", "content": "x", "tool_calls": []}]},
        400,
        "'messages[0].tool_calls' is only allowed on assistant",
    ),
    ({"messages": [{"role": "user", "content": "x", "audio": {}}]}, 400, "unsupported field(s): audio"),
    ({"messages": ["hi"]}, 400, "'messages[0]' must be an object"),
    ({"messages": [{"role": "user", "content": "a\ud800b"}]}, 400, "'messages' is not valid Unicode"),
    ({"messages": USER, "model": "other"}, 404, "The model `other` does not exist."),
    ({"messages": USER, "temperature": -0.1}, 400, "'temperature' must be between 0 and 2"),
    ({"messages": USER, "top_p": "1"}, 400, "'top_p' must be a number, got string"),
    ({"messages": USER, "max_tokens": 0}, 400, "'max_tokens' must be >= 1"),
    ({"messages": USER, "max_completion_tokens": 10**6}, 400, "maximum context length is 128 tokens"),
    ({"messages": USER, "max_tokens": 3, "max_completion_tokens": 4}, 400, "disagree"),
    ({"messages": [{"role": "user", "content": LONG}]}, 400, "input tokens. Please reduce the length of the messages"),
    ({"messages": [{"role": "user", "content": LONG}], "max_tokens": 5}, 400, "in the messages, 5 in the completion"),
    ({"messages": USER, "n": 0}, 400, "'n' must be between 1 and 128"),
    ({"messages": USER, "logprobs": 3}, 400, "'logprobs' must be a boolean, got integer"),
    ({"messages": USER, "logprobs": True, "top_logprobs": 21}, 400, "'top_logprobs' must be between 0 and 20"),
    ({"messages": USER, "top_logprobs": 2}, 400, "requires 'logprobs'"),
    ({"messages": USER, "stream": True}, 400, "'stream'"),
    ({"messages": USER, "tools": [{"type": "function", "function": {"name": "f g"}}]}, 400, "'tools[0].function.name'"),
    (
        {"messages": USER, "tool_choice": "auto"},
        400,
        "'tool_choice' \"auto\" requires 'tools'",
    ),  # tests/test_tool_calls.py
    ({"messages": USER, "response_format": {"type": "json"}}, 400, "'response_format.type' must be one of"),
    (
        {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 3}}},
        400,
        "'response_format' must be a JSON schema",
    ),
    ({"messages": USER, "guided_json": "{not json"}, 400, "'guided_json' is not valid JSON"),
    ({"messages": USER, "structured_outputs": {"regex": "a", "choice": ["b"]}}, 400, "takes one constraint"),
    ({"messages": USER, "prompt": "x"}, 400, "unknown field(s): 'prompt'"),
    ({"messages": USER, "echo": True}, 400, "unknown field(s): 'echo'"),
]


@pytest.mark.parametrize("body,status,message", BAD_COMPLETIONS)
def test_bad_completion_requests(tokenizer, body, status, message):
    with pytest.raises(OpenAIError) as info:
        parse_completion_request(body, tokenizer, MODEL, CONTEXT)
    assert info.value.status_code == status
    assert message in info.value.message


@pytest.mark.parametrize("body,status,message", BAD_CHATS)
def test_bad_chat_requests(tokenizer, body, status, message):
    with pytest.raises(OpenAIError) as info:
        parse_chat_request(body, tokenizer, MODEL, CONTEXT)
    assert info.value.status_code == status
    assert message in info.value.message


def test_error_bodies_have_openai_shape(tokenizer):
    with pytest.raises(OpenAIError) as info:
        parse_completion(tokenizer, prompt="hi", model="gpt-4")
    assert info.value.to_body() == {
        "error": {
            "message": "The model `gpt-4` does not exist.",
            "type": "invalid_request_error",
            "param": None,
            "code": "model_not_found",
        }
    }
    with pytest.raises(OpenAIError) as info:
        parse_completion(tokenizer, prompt="hi", temperature="hot")
    assert info.value.to_body()["error"] == {
        "message": "'temperature' must be a number, got string",
        "type": "invalid_request_error",
        "param": "temperature",
        "code": None,
    }


def test_an_error_naming_a_lone_surrogate_still_encodes(tokenizer):
    # JSON lets a client send "\ud800" (here as a field name the error names): the error body must
    # still encode as UTF-8, or the answer would be a 500.
    with pytest.raises(OpenAIError) as info:
        parse_completion(tokenizer, prompt="hi", **{"a\ud800": 1})
    body = json.dumps(info.value.to_body(), ensure_ascii=False).encode("utf-8")
    assert b"unknown field" in body and b"\\ud800" in body


@pytest.mark.parametrize(
    "prompt,n,choices",
    [(["hi"] * 5000, 1, 5000), (["hi"] * 4, 65, 260), ([[1], [2], [3]], 86, 258), (["hi"] * 300 + [5], 1, 301)],
)
def test_fan_out_beyond_the_limit_is_a_400_naming_it_before_any_tokenizing(tokenizer, prompt, n, choices):
    with pytest.raises(OpenAIError) as info:  # (the last prompt is malformed too: the count comes first)
        parse_completion_request(
            {"prompt": prompt, "n": n, "max_tokens": 1}, tokenizer, MODEL, CONTEXT, max_choices=256
        )
    assert info.value.status_code == 400 and info.value.code == "too_many_choices"
    assert f"asks for {choices} choices" in info.value.message and "limit is 256" in info.value.message
    assert "--max-choices" in info.value.message
    with pytest.raises(OpenAIError, match="asks for 3 choices"):
        parse_chat_request({"messages": USER, "n": 3}, tokenizer, MODEL, CONTEXT, max_choices=2)


def test_fan_out_at_the_limit_and_the_models_vocabulary(tokenizer):
    parsed = parse_completion_request(
        {"prompt": ["hi"] * 4, "n": 64, "max_tokens": 1}, tokenizer, MODEL, CONTEXT, max_choices=256
    )
    assert len(parsed.params) == 256
    # the model's vocabulary may be smaller than the tokenizer's: ids past it are refused
    with pytest.raises(OpenAIError, match=r"token ids must be in \[0, 10\)"):
        parse_completion_request({"prompt": [1, 10], "max_tokens": 1}, tokenizer, MODEL, CONTEXT, vocab_size=10)
    with pytest.raises(OpenAIError, match=r"'stop_token_ids' must be token ids in \[0, 10\)"):
        parse_completion_request({"prompt": [1], "stop_token_ids": [10]}, tokenizer, MODEL, CONTEXT, vocab_size=10)


def test_server_side_failures_are_typed_server_error():
    # A client telling its own mistakes from the server's (to retry) reads `type`, as with OpenAI.
    assert (
        OpenAIError("no healthy prefill or decode server", status_code=503).to_body()["error"]["type"] == "server_error"
    )
    assert OpenAIError("prefill failed", status_code=502).to_body()["error"]["type"] == "server_error"
    assert OpenAIError("bad key", status_code=401).to_body()["error"]["type"] == "invalid_request_error"


def test_context_length_message_is_openais(tokenizer):
    prompt_len = len(tokenizer("hello world")["input_ids"])
    with pytest.raises(OpenAIError) as info:
        parse_completion(tokenizer, prompt="hello world", max_tokens=CONTEXT)
    assert info.value.message == (
        f"This model's maximum context length is {CONTEXT} tokens. However, you requested "
        f"{prompt_len + CONTEXT} tokens ({prompt_len} in the prompt, {CONTEXT} in the completion). "
        "Please reduce the length of the prompt or completion."
    )
    assert info.value.code == "context_length_exceeded"


def test_stream_is_accepted_when_the_caller_allows_it(tokenizer):
    body = {"prompt": "hi", "stream": True, "stream_options": {"include_usage": True}}
    parsed = parse_completion_request(body, tokenizer, MODEL, CONTEXT, allow_stream=True)
    assert parsed.stream and parsed.include_usage


# ---- parsing happy paths ------------------------------------------------------------------------


def test_string_prompt_is_tokenized_with_bos_and_maps_every_field(tokenizer):
    parsed = parse_completion(
        tokenizer, model=MODEL, prompt="hello world", max_tokens=5, temperature=0.5, top_p=0.9, top_k=4,
        min_p=0.05, repetition_penalty=1.1, frequency_penalty=0.5, presence_penalty=-0.5, stop="fox",
        stop_token_ids=[7], ignore_eos=True, min_tokens=2, skip_special_tokens=False,
        include_stop_str_in_output=True, seed=3, user="u", metadata={"k": "v"}, store=False,
        logit_bias={}, best_of=1, suffix=None, echo=False,
    )  # fmt: skip
    assert parsed.kind == "completion" and parsed.model == MODEL and parsed.n == 1
    assert parsed.prompts == [tokenizer("hello world")["input_ids"]]
    assert parsed.prompts[0][0] == tokenizer.bos_token_id
    assert parsed.prompt_texts == ["hello world"]
    assert parsed.params == [
        SamplingParams(
            max_new_tokens=5, min_new_tokens=2, temperature=0.5, top_p=0.9, top_k=4, min_p=0.05, seed=3,
            repetition_penalty=1.1, frequency_penalty=0.5, presence_penalty=-0.5, stop=("fox",),
            stop_token_ids=(7,), ignore_eos=True, include_stop_str_in_output=True, logprobs=None,
            skip_special_tokens=False,
        )
    ]  # fmt: skip


def test_prompt_forms(tokenizer):
    ids = lambda text: tokenizer(text)["input_ids"]  # noqa: E731
    assert parse_completion(tokenizer, prompt=["hello", "world"]).prompts == [ids("hello"), ids("world")]
    assert parse_completion(tokenizer, prompt=[5, 6, 7]).prompts == [[5, 6, 7]]
    many = parse_completion(tokenizer, prompt=[[5, 6], [7]], echo=True)
    assert many.prompts == [[5, 6], [7]]
    assert many.prompt_texts == [tokenizer.decode([5, 6]), tokenizer.decode([7])]
    # without echo nothing reads the text, so token ids are not decoded
    assert parse_completion(tokenizer, prompt=[[5, 6], [7]]).prompt_texts == ["", ""]


def test_default_max_tokens_is_the_rest_of_the_context(tokenizer):
    parsed = parse_completion(tokenizer, prompt=["hello", "the quick brown fox"])
    for prompt, params in parsed.engine_requests():
        assert params.max_new_tokens == CONTEXT - len(prompt)
    exact = parse_completion(tokenizer, prompt=[1] * (CONTEXT - 4), max_tokens=4)  # exactly fills the context
    assert exact.params[0].max_new_tokens == 4


def test_n_choices_get_distinct_reproducible_seeds(tokenizer):
    parsed = parse_completion(tokenizer, prompt=["a", "b"], n=4, seed=42)
    seeds = [p.seed for p in parsed.params]
    assert seeds[:4] == seeds[4:]  # each prompt's choice j gets the same seed
    assert len(set(seeds[:4])) == 4 and seeds[0] == 42
    assert seeds == [p.seed for p in parse_completion(tokenizer, prompt=["a", "b"], n=4, seed=42).params]
    assert seeds != [p.seed for p in parse_completion(tokenizer, prompt=["a", "b"], n=4, seed=43).params]
    assert all(0 <= choice_seed(-1, j) < 2**64 for j in range(1, 5))
    unseeded = parse_completion(tokenizer, prompt="a", n=3)
    assert [p.seed for p in unseeded.params] == [None] * 3


def test_engine_requests_are_in_choice_index_order(tokenizer):
    parsed = parse_completion(tokenizer, prompt=[[5], [6], [7]], n=2)
    assert [prompt for prompt, _ in parsed.engine_requests()] == [[5], [5], [6], [6], [7], [7]]


def test_chat_renders_the_template_without_a_second_bos(tokenizer):
    messages = [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hel"}, {"type": "text", "text": "lo"}]},
        {"role": "assistant", "content": "hi", "name": "bot"},
        {"role": "user", "content": "again"},
    ]
    parsed = parse_chat(tokenizer, messages=messages, max_completion_tokens=5, tool_choice="none", tools=[])
    text = (
        "<|bos|><|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhello<|im_end|>\n"
        "<|im_start|>assistant\nhi<|im_end|>\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n"
    )
    assert parsed.kind == "chat" and parsed.prompt_texts == [text]
    assert parsed.prompts == [tokenizer(text, add_special_tokens=False)["input_ids"]]
    assert parsed.prompts[0].count(tokenizer.bos_token_id) == 1
    assert parsed.params[0].max_new_tokens == 5


def test_chat_logprobs_settings(tokenizer):
    assert parse_chat(tokenizer, messages=USER).logprobs is None
    assert parse_chat(tokenizer, messages=USER, logprobs=False).params[0].logprobs is None
    assert parse_chat(tokenizer, messages=USER, logprobs=True).logprobs == 0
    parsed = parse_chat(tokenizer, messages=USER, logprobs=True, top_logprobs=20, max_tokens=4)
    assert parsed.logprobs == 20 and parsed.params[0].logprobs == 20
    assert parse_chat(tokenizer, messages=USER, max_tokens=3).params[0].max_new_tokens == 3
    assert parse_chat(tokenizer, messages=USER, response_format={"type": "text"}).n == 1


def test_chat_without_a_template_is_a_400(tokenizer):
    bare = build_tokenizer()
    bare.chat_template = None
    with pytest.raises(OpenAIError, match="no chat template"):
        parse_chat(bare, messages=USER)


# ---- responses ----------------------------------------------------------------------------------


def respond(tokenizer, parsed, formatter=None):
    prompts, params = zip(*parsed.engine_requests())
    completions = fake_completions(tokenizer, prompts, params)
    formatter = formatter or (format_completion_response if parsed.kind == "completion" else format_chat_response)
    body = formatter(parsed, completions, tokenizer, "abc123", 1700000000)
    json.dumps(body, allow_nan=False)  # valid JSON, no NaN/inf
    return body, completions


def test_completion_response_shape_and_usage(tokenizer):
    parsed = parse_completion(tokenizer, prompt=["hello", "the quick brown fox"], n=3, max_tokens=4, seed=1)
    body, completions = respond(tokenizer, parsed)
    assert body["id"] == "cmpl-abc123" and body["object"] == "text_completion"
    assert body["created"] == 1700000000 and body["model"] == MODEL
    assert [c["index"] for c in body["choices"]] == list(range(6))
    for choice, completion in zip(body["choices"], completions):
        assert set(choice) == {"index", "text", "logprobs", "finish_reason"}
        assert choice["text"] == completion.text and choice["logprobs"] is None
        assert choice["finish_reason"] == completion.finish_reason.value
    prompt_tokens = len(parsed.prompts[0]) + len(parsed.prompts[1])
    completion_tokens = sum(len(c.output_ids) for c in completions)
    assert body["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        # the fake reports cached_tokens = its index: each prompt counts its first choice's (0 and 3)
        "prompt_tokens_details": {"cached_tokens": 3},
    }
    assert completion_tokens == 3 * 4 + 3 * min(4, 3 + len(parsed.prompts[1]) % 3)


def test_completion_echo_and_return_token_ids(tokenizer):
    parsed = parse_completion(tokenizer, prompt="hello", max_tokens=2, echo=True, return_token_ids=True)
    body, completions = respond(tokenizer, parsed)
    choice = body["choices"][0]
    assert choice["text"] == "hello" + completions[0].text
    assert choice["prompt_token_ids"] == parsed.prompts[0]
    assert choice["token_ids"] == completions[0].output_ids and len(choice["token_ids"]) == 2
    assert choice["finish_reason"] == "length"


def test_completion_logprobs_format(tokenizer):
    parsed = parse_completion(tokenizer, prompt="hello", max_tokens=3, logprobs=2)
    body, completions = respond(tokenizer, parsed)
    logprobs = body["choices"][0]["logprobs"]
    tokens = [tokenizer.decode([t]) for t in completions[0].output_ids]
    assert logprobs["tokens"] == tokens
    assert logprobs["token_logprobs"] == [-0.25, -0.5, -0.75]
    assert logprobs["text_offset"] == [0, len(tokens[0]), len(tokens[0]) + len(tokens[1])]
    # the top 2 plus the sampled token (unless it is among them)
    for top, token, lp in zip(logprobs["top_logprobs"], tokens, logprobs["token_logprobs"]):
        expected = {"a": -0.125, "b": -0.25}
        expected.setdefault(token, lp)
        assert top == expected


def test_completion_logprobs_zero_gives_the_sampled_token_only(tokenizer):
    parsed = parse_completion(tokenizer, prompt="hello", max_tokens=2, logprobs=0)
    body, completions = respond(tokenizer, parsed)
    logprobs = body["choices"][0]["logprobs"]
    assert logprobs["top_logprobs"] == [{tok: lp} for tok, lp in zip(logprobs["tokens"], logprobs["token_logprobs"])]


def test_chat_response_shape_logprobs_and_usage(tokenizer):
    parsed = parse_chat(tokenizer, messages=USER, n=2, max_tokens=3, logprobs=True, top_logprobs=2, seed=5)
    body, completions = respond(tokenizer, parsed)
    assert body["id"] == "chatcmpl-abc123" and body["object"] == "chat.completion" and body["model"] == MODEL
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["choices"][0]["message"] == {"role": "assistant", "content": completions[0].text}
    assert completions[0].output_ids != completions[1].output_ids  # distinct seeds
    content = body["choices"][1]["logprobs"]["content"]
    assert [entry["token"] for entry in content] == [tokenizer.decode([t]) for t in completions[1].output_ids]
    assert content[0]["logprob"] == -0.25 and content[0]["bytes"] == list(content[0]["token"].encode())
    assert content[0]["top_logprobs"] == [
        {"token": "a", "logprob": -0.125, "bytes": [97]},
        {"token": "b", "logprob": -0.25, "bytes": [98]},
    ]
    prompt_tokens = len(parsed.prompts[0])
    assert body["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": 6,
        "total_tokens": prompt_tokens + 6,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def test_chat_without_logprobs_and_with_token_ids(tokenizer):
    parsed = parse_chat(tokenizer, messages=USER, max_tokens=2, return_token_ids=True)
    body, completions = respond(tokenizer, parsed)
    choice = body["choices"][0]
    assert choice["logprobs"] is None and choice["finish_reason"] == "length"
    assert choice["prompt_token_ids"] == parsed.prompts[0] and choice["token_ids"] == completions[0].output_ids


def test_minus_infinity_logprobs_are_clamped(tokenizer):
    parsed = parse_chat(tokenizer, messages=USER, max_tokens=1, logprobs=True, top_logprobs=1)
    token = tokenizer.convert_tokens_to_ids("a")
    lp = TokenLogprob(token, float("-inf"), top=[(token, float("-inf"))])
    done = Completion("r", parsed.prompts[0], [token], "a", FinishReason.LENGTH, logprobs=[lp])
    body = format_chat_response(parsed, [done], tokenizer, "x", 0)
    entry = body["choices"][0]["logprobs"]["content"][0]
    assert entry["logprob"] == MIN_LOGPROB and entry["top_logprobs"][0]["logprob"] == MIN_LOGPROB


def test_completion_count_must_match_choices(tokenizer):
    parsed = parse_completion(tokenizer, prompt="hi", n=2, max_tokens=1)
    with pytest.raises(ValueError, match="expected 2 completions"):
        format_completion_response(parsed, [], tokenizer, "x", 0)


def test_openai_modules_do_not_import_torch():
    code = (
        "import sys, pdserve.common.openai.api, pdserve.common.openai.format, pdserve.common.openai.run_batch; "
        "sys.exit('torch' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_completion_echo_with_logprobs_leads_with_the_prompt(tokenizer):
    from pdserve.common.types import TokenLogprob

    parsed = parse_completion(tokenizer, prompt="the quick brown fox", max_tokens=2, echo=True, logprobs=1)
    assert all(p.prompt_logprobs == 1 for p in parsed.params)
    ids = parsed.prompts[0]
    prompt_lps = [None] + [TokenLogprob(t, -1.5 - i, [(7, -0.5), (8, -0.75)], rank=3) for i, t in enumerate(ids[1:])]
    completions = fake_completions(tokenizer, [ids], parsed.params)
    completions[0].prompt_logprobs = prompt_lps
    body = format_completion_response(parsed, completions, tokenizer, "abc", 1)
    lp = body["choices"][0]["logprobs"]
    n = len(ids)
    assert lp["tokens"][:n] == [tokenizer.decode([t]) for t in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:n] == [-1.5 - i for i in range(n - 1)]
    assert lp["top_logprobs"][1] == {tokenizer.decode([7]): -0.5, tokenizer.decode([ids[1]]): -1.5}
    assert len(lp["tokens"]) == n + 2  # then the two generated tokens
    assert lp["text_offset"][:2] == [0, len(tokenizer.decode([ids[0]]))]
    assert body["choices"][0]["text"].startswith("the quick brown fox")


def test_prompt_logprobs_are_not_streamed(tokenizer):
    with pytest.raises(OpenAIError, match="not available when 'stream'"):
        parse_completion_request(
            {"prompt": "hi", "prompt_logprobs": 1, "stream": True}, tokenizer, MODEL, CONTEXT, allow_stream=True
        )


def test_vllm_prompt_logprobs_field(tokenizer):
    from pdserve.common.types import TokenLogprob

    parsed = parse_completion(tokenizer, prompt="hello world", max_tokens=0, prompt_logprobs=1)
    assert parsed.params[0].max_new_tokens == 0 and parsed.params[0].prompt_logprobs == 1
    ids = parsed.prompts[0]
    completions = fake_completions(tokenizer, [ids], parsed.params)
    completions[0].prompt_logprobs = [None] + [TokenLogprob(t, -2.0, [(5, -0.1)], rank=4) for t in ids[1:]]
    body = format_completion_response(parsed, completions, tokenizer, "abc", 1)
    field = body["choices"][0]["prompt_logprobs"]
    assert field[0] is None and len(field) == len(ids)
    assert field[1] == {
        str(ids[1]): {"logprob": -2.0, "rank": 4, "decoded_token": tokenizer.decode([ids[1]])},
        "5": {"logprob": -0.1, "rank": 1, "decoded_token": tokenizer.decode([5])},
    }
    assert body["choices"][0]["logprobs"] is None  # prompt_logprobs alone asks for no legacy object
