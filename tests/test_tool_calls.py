"""OpenAI tool calling: `tools`/`tool_choice` validation, the chat template with tools and tool
results, the forced-call structural tag (compiled and matched with xgrammar on the tiny model's
tokenizer), and the <tool_call> parser, whole and streamed, on CPU without servers.

The end-to-end checks (real servers, the official openai client) belong with the engine's grammar
support; `check_forced_answer` and `merge_stream` below are what they should assert."""

from __future__ import annotations

import copy
import json
import random

import pytest

from pdserve.common.openai.api import OpenAIError
from pdserve.common.openai.chat import parse_chat_request, tools_prompt
from pdserve.common.openai.format import format_chat_response
from pdserve.common.openai.tool_parser import ToolCallStream, parse_tool_calls, tool_names
from pdserve.common.types import Completion, FinishReason, TokenLogprob
from pdserve.router.stream_chunks import StreamChunks
from tests.test_openai_api import build_tokenizer

MODEL, CONTEXT = "tiny", 4096  # (the tools prompt alone is ~600 of the tiny tokenizer's tokens)
USER = [{"role": "user", "content": "weather in Paris?"}]
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
    "required": ["city"],
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather of a city", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time"}},  # no parameters: {"type": "object", "properties": {}}
]
NAMES = frozenset({"get_weather", "get_time"})
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CALL2 = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'

# A Hermes-style template (as Qwen2.5's, cut down): tools in the system turn, calls and results in tags.
HERMES = (  # NOTE: transformers renders with trim_blocks: a newline right after a block tag is dropped
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>"
    "{% for tool in tools %}{{ '\\n' + tool | tojson }}{% endfor %}{{ '\\n' }}</tools><|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    '{% for call in m.tool_calls or [] %}<tool_call>\n{"name": "{{ call.function.name }}", "arguments": '
    "{{ call.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()  # ChatML: its template does not render tools


@pytest.fixture(scope="module")
def hermes(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = HERMES
    return tok


def parse(tokenizer, **body):
    return parse_chat_request({"messages": USER} | body, tokenizer, MODEL, CONTEXT, allow_stream=True)


# ---- request validation -----------------------------------------------------------------------------

FN = {"type": "function", "function": {"name": "f"}}
BAD = [  # (body fields, param, substring of the message)
    ({"tools": FN}, "tools", "'tools' must be an array of tools, got object"),
    ({"tools": ["f"]}, "tools", "'tools[0]' must be an object, got string"),
    ({"tools": [{"type": "custom", "function": {"name": "f"}}]}, "tools", "'tools[0].type' must be \"function\""),
    ({"tools": [{"type": "function"}]}, "tools", "'tools[0].function' must be an object, got null"),
    ({"tools": [FN | {"x": 1}]}, "tools", "'tools[0]' has unsupported field(s): x"),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "returns": {}}}]},
        "tools",
        "'tools[0].function' has unsupported field(s): returns",
    ),
    (
        {"tools": [{"type": "function", "function": {"name": "get weather"}}]},
        "tools",
        "'tools[0].function.name' must be 1 to 64 of a-z",
    ),
    ({"tools": [{"type": "function", "function": {"name": "f" * 65}}]}, "tools", "'tools[0].function.name'"),
    ({"tools": [{"type": "function", "function": {}}]}, "tools", "'tools[0].function.name' must be"),
    ({"tools": [FN, FN]}, "tools", "'tools[1].function.name' repeats 'f'; names must be unique"),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
        "tools",
        "'tools[0].function.parameters' must be a JSON schema object, got array",
    ),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"maximum": float("nan")}}}]},
        "tools",
        "must not hold NaN or Infinity",
    ),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "description": 3}}]},
        "tools",
        "'tools[0].function.description' must be a string, got integer",
    ),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]},
        "tools",
        "'tools[0].function.strict' must be a boolean",
    ),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "description": "a\ud800"}}]},
        "tools",
        "'tools' is not valid Unicode",
    ),
    (
        {"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]},
        "tools",
        "'tools' takes at most 128 tools, got 129",
    ),
    ({"tool_choice": "auto"}, "tool_choice", "'tool_choice' \"auto\" requires 'tools'"),
    ({"tool_choice": "required", "tools": []}, "tool_choice", "requires 'tools'"),
    ({"tools": TOOLS, "tool_choice": "any"}, "tool_choice", '\'tool_choice\' must be "none", "auto", "required"'),
    ({"tools": TOOLS, "tool_choice": 1}, "tool_choice", "'tool_choice' must be a string or an object, got integer"),
    (
        {"tools": TOOLS, "tool_choice": {"type": "function", "name": "get_time"}},
        "tool_choice",
        "'tool_choice' as an object must be",
    ),
    (
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice",
        "'tool_choice' names the function 'nope', which is not in 'tools'",
    ),
    ({"functions": [{"name": "f"}]}, "functions", "'functions' is not supported"),
    ({"function_call": "auto"}, "function_call", "'function_call' is not supported"),
    ({"tools": TOOLS, "parallel_tool_calls": "no"}, "parallel_tool_calls", "'parallel_tool_calls' must be a boolean"),
]
CALLED = {
    "role": "assistant",
    "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    ],
}
BAD_MESSAGES = [  # (messages, substring of the message); param "messages"
    (
        USER + [{"role": "tool", "content": "sunny"}],
        "'messages[1].tool_call_id' must be a string (the call answered), got null",
    ),
    (
        USER + [{"role": "user", "content": "x", "tool_calls": []}],
        "'messages[1].tool_calls' is only allowed on assistant",
    ),
    (
        USER + [{"role": "user", "content": "x", "tool_call_id": "c1"}],
        "'messages[1].tool_call_id' is only allowed on tool",
    ),
    (USER + [{"role": "assistant", "tool_calls": {}}], "'messages[1].tool_calls' must be an array, got object"),
    (USER + [{"role": "assistant", "tool_calls": []}], "'messages[1].content' is required"),
    (USER + [{"role": "assistant", "tool_calls": ["x"]}], "'messages[1].tool_calls[0]' must be {\"id\""),
    (
        USER
        + [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f"}, "x": 1}]}],
        "'messages[1].tool_calls[0]' has unsupported field(s): x",
    ),
    (
        USER
        + [{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]}],
        "'messages[1].tool_calls[0].id' must be a string, got null",
    ),
    (
        USER + [{"role": "assistant", "tool_calls": [{"id": "c", "function": {"arguments": "{}"}}]}],
        "'messages[1].tool_calls[0].function.name' must be a string",
    ),
    (
        USER + [{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{x"}}]}],
        "'messages[1].tool_calls[0].function.arguments' must be a JSON object (as a string)",
    ),
    (
        USER + [{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "[1]"}}]}],
        "'messages[1].tool_calls[0].function.arguments' must be a JSON object, got array",
    ),
    (
        USER
        + [{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{}", "y": 2}}]}],
        "'messages[1].tool_calls[0].function' has unsupported field(s): y",
    ),
    (
        [{"role": "function", "content": "x"}],
        "'messages[0].role' must be one of system, developer, user, assistant, tool",
    ),
]


@pytest.mark.parametrize("fields,param,message", BAD)
def test_bad_tool_fields_are_400s_naming_the_param(tokenizer, fields, param, message):
    with pytest.raises(OpenAIError) as info:
        parse(tokenizer, **fields)
    assert (info.value.status_code, info.value.param) == (400, param)
    assert message in info.value.message


@pytest.mark.parametrize("messages,message", BAD_MESSAGES)
def test_bad_tool_messages_are_400s(tokenizer, messages, message):
    with pytest.raises(OpenAIError) as info:
        parse(tokenizer, messages=messages)
    assert (info.value.status_code, info.value.param) == (400, "messages")
    assert message in info.value.message


def test_tool_choice_defaults_and_normal_forms(tokenizer):
    plain = parse(tokenizer)
    assert (plain.tools, plain.tool_choice, plain.params[0].grammar) == (None, "none", None)
    assert parse(tokenizer, tools=[], tool_choice="none").tool_choice == "none"  # empty tools ask for nothing
    auto = parse(tokenizer, tools=TOOLS)
    assert auto.tool_choice == "auto" and auto.params[0].grammar is None
    assert auto.tools[1] == {
        "type": "function",
        "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
    }
    assert auto.tools[0]["function"] == TOOLS[0]["function"]
    named = {"type": "function", "function": {"name": "get_time"}}
    assert parse(tokenizer, tools=TOOLS, tool_choice=named).tool_choice == named
    none = parse(tokenizer, tools=TOOLS, tool_choice="none")
    assert none.params[0].grammar is None and tool_names(none) is None
    assert tool_names(auto) == NAMES


def test_forced_calls_get_a_structural_tag(tokenizer):
    required = parse(tokenizer, tools=TOOLS, tool_choice="required", n=2)
    kind, spec = required.params[0].grammar
    assert kind == "structural_tag" and all(p.grammar == (kind, spec) for p in required.params)
    form = json.loads(spec)["format"]
    assert form["type"] == "tags_with_separator" and form["separator"] == "\n"
    assert (form["at_least_one"], form["stop_after_first"]) == (True, False)
    assert form["tags"][0] == {
        "type": "tag", "begin": '<tool_call>\n{"name": "get_weather", "arguments": ',
        "content": {"type": "json_schema", "json_schema": WEATHER, "max_whitespace_cnt": 1}, "end": "}\n</tool_call>",
    }  # fmt: skip
    single = parse(tokenizer, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert json.loads(single.params[0].grammar[1])["format"]["stop_after_first"] is True
    named = parse(tokenizer, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})
    form = json.loads(named.params[0].grammar[1])["format"]
    assert form["type"] == "tag" and form["begin"] == '<tool_call>\n{"name": "get_time", "arguments": '


def test_a_forced_call_cannot_combine_with_structured_output(tokenizer):
    json_object = {"type": "json_object"}
    with pytest.raises(OpenAIError, match="cannot combine a structured-output constraint .* with a 'tool_choice'"):
        parse(tokenizer, tools=TOOLS, tool_choice="required", response_format=json_object)
    with pytest.raises(OpenAIError, match="cannot combine"):
        parse(
            tokenizer,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "get_time"}},
            guided_regex="a+",
        )
    # "auto": the model decides, under the client's grammar.
    assert parse(tokenizer, tools=TOOLS, response_format=json_object).params[0].grammar == ("json_object", "")


def test_call_tags_survive_skip_special_tokens(tokenizer):
    """A tokenizer whose <tool_call> is special would have decode erase it: parsing turns the skip off."""
    special = copy.deepcopy(tokenizer)
    special.add_special_tokens({"additional_special_tokens": ["<tool_call>", "</tool_call>"]})
    assert parse(special, tools=TOOLS).params[0].skip_special_tokens is False
    assert parse(special, tools=TOOLS, skip_special_tokens=True).params[0].skip_special_tokens is True  # the client's
    assert parse(special, tools=TOOLS, tool_choice="none").params[0].skip_special_tokens is True
    assert parse(tokenizer, tools=TOOLS).params[0].skip_special_tokens is True


# ---- the chat template --------------------------------------------------------------------------------

CONVERSATION = USER + [CALLED, {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]


def test_a_template_without_tools_gets_them_in_a_system_message(tokenizer):
    """The tiny ChatML template does not render tools: they are told to the model by the built-in
    Hermes tools prompt, closing the system message (or in one of their own), never dropped; a
    call's turn has content "" (as vLLM)."""
    told = parse(tokenizer, tools=TOOLS)  # (its tools: TOOLS, each with its parameters defaulted)
    plain, with_tools = parse(tokenizer).prompt_texts[0], told.prompt_texts[0]
    prompt = tools_prompt(told.tools)
    assert with_tools == "<|bos|><|im_start|>system\n" + prompt + "<|im_end|>\n" + plain[len("<|bos|>") :]
    for tool in told.tools:
        assert json.dumps(tool) in with_tools
    system = [{"role": "system", "content": "Be brief."}]
    told = parse(tokenizer, messages=system + USER, tools=TOOLS).prompt_texts[0]
    assert (
        told.startswith("<|bos|><|im_start|>system\nBe brief.\n\n# Tools\n") and told.count("<|im_start|>system") == 1
    )
    assert parse(tokenizer, tools=TOOLS, tool_choice="none").prompt_texts[0] == plain  # "none": no tools told
    parsed = parse(tokenizer, messages=CONVERSATION, tools=TOOLS)
    assert parsed.prompt_texts == [
        "<|bos|><|im_start|>system\n" + prompt + "<|im_end|>\n"
        "<|im_start|>user\nweather in Paris?<|im_end|>\n<|im_start|>assistant\n<|im_end|>\n"
        "<|im_start|>tool\nsunny<|im_end|>\n<|im_start|>assistant\n"
    ]
    assert parsed.messages[1] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
        ],
    }
    assert parsed.messages[2] == {"role": "tool", "content": "sunny", "tool_call_id": "c1"}


def test_a_hermes_template_renders_tools_calls_and_results(hermes):
    text = parse(hermes, messages=CONVERSATION, tools=TOOLS).prompt_texts[0]
    assert text == (
        "<|im_start|>system\n# Tools\n<tools>\n"
        + json.dumps(TOOLS[0])
        + "\n"
        + json.dumps(
            {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
        )
        + "\n</tools><|im_end|>\n<|im_start|>user\nweather in Paris?<|im_end|>\n<|im_start|>assistant\n"
        + CALL
        + "<|im_end|>\n<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    # "none": the model is not told of tools it may not call (the history's calls stay).
    none = parse(hermes, messages=CONVERSATION, tools=TOOLS, tool_choice="none").prompt_texts[0]
    assert "<tools>" not in none and CALL in none


# ---- the forced-call grammar, compiled and matched by xgrammar ------------------------------------------


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory):
    """The tiny model's own tokenizer (common/tiny_model.py), as the servers load it."""
    from transformers import AutoTokenizer

    from pdserve.common.tiny_model import write_tokenizer

    out = tmp_path_factory.mktemp("tokenizer")
    write_tokenizer(out)
    return AutoTokenizer.from_pretrained(out)


@pytest.fixture(scope="module")
def matcher_of(tiny_tokenizer):
    xgr = pytest.importorskip("xgrammar")
    info = xgr.TokenizerInfo.from_huggingface(tiny_tokenizer, stop_token_ids=[tiny_tokenizer.eos_token_id])
    compiler = xgr.GrammarCompiler(info, max_threads=1)

    def matcher(grammar: tuple[str, str]):
        kind, spec = grammar
        assert kind == "structural_tag"
        return xgr.GrammarMatcher(compiler.compile_grammar(xgr.Grammar.from_structural_tag(spec)))

    return matcher


def accepts(matcher, text: str, eos: int) -> bool:
    """Whether the grammar takes `text` as a whole answer: every character, then the stop token."""
    return matcher.accept_string(text) and matcher.accept_token(eos) and matcher.is_terminated()


@pytest.mark.parametrize("parallel", [True, False])
def test_required_grammar_takes_calls_and_nothing_else(tiny_tokenizer, matcher_of, parallel):
    grammar = parse(tiny_tokenizer, tools=TOOLS, tool_choice="required", parallel_tool_calls=parallel).params[0].grammar
    eos = tiny_tokenizer.eos_token_id
    assert accepts(matcher_of(grammar), CALL, eos) and accepts(matcher_of(grammar), CALL2, eos)
    assert accepts(matcher_of(grammar), CALL + "\n" + CALL2, eos) is parallel
    for wrong in [
        "Sure! " + CALL,
        "",
        "hello",
        CALL.replace("Paris", "Oslo"),
        CALL.replace('"Paris"', '"Paris", "x": 1'),
        CALL.replace("get_weather", "get_wether"),
        CALL + " trailing",
    ]:
        assert not accepts(matcher_of(grammar), wrong, eos), wrong
    # What the grammar lets out, the parser reads as calls.
    content, calls = parse_tool_calls(CALL + "\n" + CALL2, NAMES)
    assert content is None and [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]


def test_named_grammar_takes_one_call_of_that_function(tiny_tokenizer, matcher_of):
    named = {"type": "function", "function": {"name": "get_weather"}}
    grammar = parse(tiny_tokenizer, tools=TOOLS, tool_choice=named).params[0].grammar
    eos = tiny_tokenizer.eos_token_id
    assert accepts(matcher_of(grammar), CALL, eos)
    for wrong in [CALL2, CALL + "\n" + CALL, "The weather: " + CALL, CALL.replace('{"city": "Paris"}', "{}")]:
        assert not accepts(matcher_of(grammar), wrong, eos), wrong


# ---- the answer: calls parsed out of the text -------------------------------------------------------------

PARSES = [  # (text, content, [(name, arguments)])
    (CALL, None, [("get_weather", '{"city": "Paris"}')]),
    (CALL + "\n" + CALL2, None, [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]),
    ("Let me check.\n\n" + CALL, "Let me check.", [("get_weather", '{"city": "Paris"}')]),
    ("Checking. " + CALL + "\nDone.", "Checking.\nDone.", [("get_weather", '{"city": "Paris"}')]),
    ('<tool_call>{"name":"get_time","arguments":{ }}</tool_call>', None, [("get_time", "{}")]),
    (
        '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}</tool_call>',
        None,
        [("get_weather", '{"city": "Rome"}')],
    ),  # arguments encoded twice
    ("  just text, <b>no</b> calls <tool  \n", "just text, <b>no</b> calls <tool", []),
    (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>',
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>',
        [],
    ),  # bad JSON: content
    ("a " + CALL.replace("get_weather", "rm_rf"), "a " + CALL.replace("get_weather", "rm_rf"), []),  # unknown name
    (
        '<tool_call>{"name": ["get_time"], "arguments": {}}</tool_call>',
        '<tool_call>{"name": ["get_time"], "arguments": {}}</tool_call>',
        [],
    ),
    (
        '<tool_call>{"name": "get_time", "arguments": {}, "id": 1}</tool_call>',
        '<tool_call>{"name": "get_time", "arguments": {}, "id": 1}</tool_call>',
        [],
    ),
    (
        '<tool_call>{"name": "get_time", "arguments": [1]}</tool_call>',
        '<tool_call>{"name": "get_time", "arguments": [1]}</tool_call>',
        [],
    ),
    (
        '<tool_call>{"name": "get_time", "arguments": {"x": NaN}}</tool_call>',
        '<tool_call>{"name": "get_time", "arguments": {"x": NaN}}</tool_call>',
        [],
    ),
    ("Sure.\n" + CALL[:30], "Sure.\n" + CALL[:30], []),  # cut off inside a call: content
    (CALL + "\n" + CALL2[:-3], CALL2[:-3], [("get_weather", '{"city": "Paris"}')]),
    ("Sure <tool_ca", "Sure <tool_ca", []),
    ("   \n", None, []),
    ("", None, []),
]


@pytest.mark.parametrize("text,content,calls", PARSES)
def test_parse_tool_calls(text, content, calls):
    got_content, got_calls = parse_tool_calls(text, NAMES)
    assert got_content == content
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in got_calls] == calls
    for call in got_calls:
        assert call["type"] == "function" and call["id"].startswith("call_") and len(call["id"]) == 29
    assert len({c["id"] for c in got_calls}) == len(got_calls)


def streamed(text: str, cuts: list[int]) -> tuple[list[str], list[dict]]:
    """The text fed at `cuts`: (the content pieces, the calls) in order."""
    stream, items, start = ToolCallStream(NAMES), [], 0
    for cut in sorted(cuts) + [len(text)]:
        items += stream.feed(text[start:cut])
        start = cut
    items += stream.finish()
    return [i for i in items if isinstance(i, str)], [i for i in items if isinstance(i, dict)]


@pytest.mark.parametrize("text", [text for text, _, _ in PARSES])
def test_streamed_parse_equals_the_whole_parse(text):
    """Every split in two, every character alone, and random splits: the same content and calls;
    no content piece is empty, and no part of a call's tag leaks into the content."""
    content, calls = parse_tool_calls(text, NAMES)
    rng = random.Random(len(text))
    splits = [[k] for k in range(len(text) + 1)] + [list(range(len(text)))]
    splits += [rng.sample(range(len(text) + 1), min(len(text), rng.randint(1, 6))) for _ in range(30)]
    for cuts in splits:
        pieces, got = streamed(text, cuts)
        assert ("".join(pieces) or None) == content, cuts
        assert [c["function"] for c in got] == [c["function"] for c in calls], cuts
        assert all(pieces)
        if calls and content is None:
            assert pieces == []


# ---- the response body and the stream -------------------------------------------------------------------


def completion(tokenizer, text: str, finish=FinishReason.STOP, logprobs=None) -> Completion:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return Completion("r", [1, 2], ids, text, finish, logprobs=logprobs)


def test_the_response_carries_the_calls(tokenizer):
    parsed = parse(tokenizer, tools=TOOLS)
    body = format_chat_response(parsed, [completion(tokenizer, "Checking.\n" + CALL)], tokenizer, "x", 0)
    [choice] = body["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Checking."
    [call] = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    cut = format_chat_response(parsed, [completion(tokenizer, CALL, FinishReason.LENGTH)], tokenizer, "x", 0)
    assert cut["choices"][0]["finish_reason"] == "length"  # cut short, though the call closed
    plain = format_chat_response(parsed, [completion(tokenizer, " Hello ")], tokenizer, "x", 0)["choices"][0]
    assert plain["message"] == {"role": "assistant", "content": "Hello"} and plain["finish_reason"] == "stop"
    none = parse(tokenizer, tools=TOOLS, tool_choice="none")
    raw = format_chat_response(none, [completion(tokenizer, CALL)], tokenizer, "x", 0)["choices"][0]
    assert raw["message"] == {"role": "assistant", "content": CALL} and raw["finish_reason"] == "stop"


def merge_stream(events: list[dict]) -> dict[int, dict]:
    """Chat chunks (parsed SSE data, [DONE] left out) merged per choice index, as a client does:
    {index: {"content": str | None, "tool_calls": [{id, type, function}], "finish_reason"}}. Checks
    the chunk rules on the way: a call comes whole in one delta, its indexes count up from 0."""
    choices: dict[int, dict] = {}
    for event in events:
        for choice in event["choices"]:
            merged = choices.setdefault(choice["index"], {"content": None, "tool_calls": [], "finish_reason": None})
            assert merged["finish_reason"] is None, "a chunk after the finish"
            delta = choice["delta"]
            if delta.get("content"):
                merged["content"] = (merged["content"] or "") + delta["content"]
            for call in delta.get("tool_calls") or []:  # (the openai client's model_dump() has None)
                assert call["index"] == len(merged["tool_calls"]) and call["type"] == "function"
                assert call["id"].startswith("call_") and json.loads(call["function"]["arguments"]) is not None
                merged["tool_calls"].append({k: call[k] for k in ("id", "type", "function")})
            merged["finish_reason"] = choice["finish_reason"]
    return choices


def check_forced_answer(
    message: dict, finish_reason: str, tools: list[dict], only: str | None = None, parallel: bool = True
) -> None:
    """What a tool_choice "required" (or named: `only`) answer must be, streamed (merge_stream's
    entry) or not (choices[i]["message"], e.g. the openai client's `.model_dump()`): no content,
    finish_reason "tool_calls", one or more calls (one without `parallel`) of the given tools (of
    `only`), arguments a JSON object with the schema's required keys. For the e2e test."""
    assert message["content"] is None and finish_reason == "tool_calls", (message, finish_reason)
    calls = message["tool_calls"]
    assert calls and (parallel or len(calls) == 1) and (only is None or len(calls) == 1)
    schemas = {t["function"]["name"]: t["function"].get("parameters", {}) for t in tools}
    for call in calls:
        name = call["function"]["name"]
        assert name in schemas and (only is None or name == only)
        arguments = json.loads(call["function"]["arguments"])
        assert isinstance(arguments, dict) and set(schemas[name].get("required", [])) <= set(arguments)


def stream_of(tokenizer, parsed, texts: list[list[str]], finishes: list[str], logprobs: bool = False) -> list[dict]:
    """The chunks router/app.py sends for choices whose text arrives in `texts` deltas."""
    chunks = StreamChunks(parsed, tokenizer, "x", 0)
    events = [chunks.choice(i, None, None, role=True) for i in range(len(texts))]
    for index, deltas in enumerate(texts):
        for delta in deltas:
            lp = [TokenLogprob(5, -0.5, top=[(5, -0.5)])] if logprobs else None
            events += chunks.text(index, delta, lp)
    for index, finish in enumerate(finishes):
        events += chunks.finish(index, finish)
    return [json.loads(event) for event in events]


def test_the_stream_carries_the_calls(tokenizer):
    parsed = parse(tokenizer, tools=TOOLS, n=2)
    answer = "Checking.\n" + CALL + "\n" + CALL2
    deltas = [answer[k : k + 7] for k in range(0, len(answer), 7)]  # "<tool_call>" split across deltas
    merged = merge_stream(stream_of(tokenizer, parsed, [deltas, ["Hi", " there <tool_"]], ["stop", "length"]))
    assert merged[0]["content"] == "Checking." and merged[0]["finish_reason"] == "tool_calls"
    assert [c["function"] for c in merged[0]["tool_calls"]] == [
        {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"name": "get_time", "arguments": "{}"},
    ]
    assert merged[1] == {"content": "Hi there <tool_", "tool_calls": [], "finish_reason": "length"}
    # Streamed and not, the same message.
    one = parse(tokenizer, tools=TOOLS)
    [choice] = format_chat_response(one, [completion(tokenizer, answer)], tokenizer, "x", 0)["choices"]
    assert choice["message"]["content"] == merged[0]["content"]
    assert [c["function"] for c in choice["message"]["tool_calls"]] == [c["function"] for c in merged[0]["tool_calls"]]
    with pytest.raises(AssertionError):  # content beside the calls: not what a forced call gives
        check_forced_answer(merged[0], merged[0]["finish_reason"], TOOLS)


def test_check_forced_answer_on_both_paths(tokenizer):
    """The e2e assertions, on what this side makes of a forced answer's text."""
    parsed = parse(tokenizer, tools=TOOLS, tool_choice="required")
    answer = CALL + "\n" + CALL2
    [streamed] = merge_stream(stream_of(tokenizer, parsed, [[answer[:9], answer[9:]]], ["stop"])).values()
    [choice] = format_chat_response(parsed, [completion(tokenizer, answer)], tokenizer, "x", 0)["choices"]
    for message, finish in ((streamed, streamed["finish_reason"]), (choice["message"], choice["finish_reason"])):
        check_forced_answer(message, finish, TOOLS)
        with pytest.raises(AssertionError):
            check_forced_answer(message, finish, TOOLS, parallel=False)
        with pytest.raises(AssertionError):
            check_forced_answer(message, finish, TOOLS, only="get_weather")
    [single] = merge_stream(stream_of(tokenizer, parsed, [[CALL]], ["stop"])).values()
    check_forced_answer(single, single["finish_reason"], TOOLS, only="get_weather", parallel=False)


def test_a_forced_answer_cut_short_sends_no_raw_call_text(tokenizer):
    """With tool_choice forcing calls, a call that max_tokens cut short is dropped, not sent as
    content (under "auto" it is content: the model may have meant it as text)."""
    cut = CALL + "\n" + CALL2[:30]
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        parsed = parse(tokenizer, tools=TOOLS, tool_choice=choice)
        [streamed] = merge_stream(stream_of(tokenizer, parsed, [[cut[:20], cut[20:]]], ["length"])).values()
        [whole] = format_chat_response(parsed, [completion(tokenizer, cut, FinishReason.LENGTH)], tokenizer, "x", 0)[
            "choices"
        ]
        for message, finish in ((streamed, streamed["finish_reason"]), (whole["message"], whole["finish_reason"])):
            assert not message["content"] and finish == "length"
            assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"]
    auto = parse(tokenizer, tools=TOOLS)
    [whole] = format_chat_response(auto, [completion(tokenizer, cut, FinishReason.LENGTH)], tokenizer, "x", 0)[
        "choices"
    ]
    assert whole["message"]["content"] == CALL2[:30]


def test_held_text_keeps_its_logprobs(tokenizer):
    parsed = parse(tokenizer, tools=TOOLS, logprobs=True)
    events = stream_of(tokenizer, parsed, [["ok <tool", "_call>\n{"]], ["stop"], logprobs=True)
    deltas = [(e["choices"][0]["delta"], e["choices"][0]["logprobs"] is not None) for e in events]
    assert deltas == [
        ({"role": "assistant", "content": ""}, False),
        ({"content": "ok"}, True),
        ({}, True),
        ({"content": " <tool_call>\n{"}, False),
        ({}, False),
    ]
    assert events[-1]["choices"][0]["finish_reason"] == "stop"  # an unclosed call is no call


def test_without_tools_the_stream_is_unchanged(tokenizer):
    for parsed in (parse(tokenizer), parse(tokenizer, tools=TOOLS, tool_choice="none")):
        chunks = StreamChunks(parsed, tokenizer, "x", 0)
        assert chunks.text(0, CALL, None) == [chunks.choice(0, CALL, None)]
        assert chunks.text(0, "", None) == [chunks.choice(0, "", None)]
        assert chunks.finish(0, "stop") == [chunks.choice(0, None, "stop")]


# ---- through the router's HTTP app and the official client, the engine faked --------------------------------


@pytest.fixture(scope="module")
def client(tiny_models):
    """An openai client on the router app (in process), whose choices answer CALL + CALL2 when a
    grammar forces calls and "Let me see. " + CALL otherwise, 5 characters a delta."""
    openai = pytest.importorskip("openai")
    from fastapi.testclient import TestClient

    from pdserve.common.ports import free_port
    from pdserve.router.app import Router, RouterConfig, create_app

    config = RouterConfig(
        tiny_models("llama"), (f"127.0.0.1:{free_port()}",), (f"127.0.0.1:{free_port()}",), served_model_name="tiny"
    )
    router = Router(config)

    async def choice(prompt_ids, params, on_text=None, on_prompt=None, arrived=None, trace=None):
        text = CALL + "\n" + CALL2 if params.grammar is not None else "Let me see. " + CALL
        if on_prompt is not None:
            await on_prompt(None)
        for k in range(0, len(text), 5):
            if on_text is not None:
                await on_text(text[k : k + 5], None)
        ids = router.tokenizer(text, add_special_tokens=False)["input_ids"]
        return Completion("r", list(prompt_ids), ids, text, FinishReason.STOP)

    router.choice = choice
    router.ready = lambda: {"prefill": ["p"], "decode": ["d"]}  # no servers: nothing is asked of them
    with TestClient(create_app(router)) as http:
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0)


@pytest.mark.parametrize("stream", [False, True])
def test_the_openai_client_reads_the_calls(client, stream):
    for tool_choice, forced in (("required", True), ("auto", False)):
        answer = client.chat.completions.create(
            model="tiny", messages=USER, tools=TOOLS, tool_choice=tool_choice, max_tokens=50, stream=stream
        )
        if stream:
            [merged] = merge_stream([chunk.model_dump() for chunk in answer]).values()
            message, finish = merged, merged["finish_reason"]
        else:
            message, finish = answer.choices[0].message.model_dump(), answer.choices[0].finish_reason
        if forced:
            check_forced_answer(message, finish, TOOLS)
        else:
            assert message["content"] == "Let me see." and finish == "tool_calls"
            assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"]
    with pytest.raises(Exception, match="requires 'tools'"):
        client.chat.completions.create(model="tiny", messages=USER, tool_choice="required", stream=stream)


def test_no_tool_body_breaks_the_parser(tokenizer):
    """Junk and near-valid tools, tool choices and tool messages: a 400 (OpenAIError) or a parse,
    never another exception; what parses, the answer parser and the stream take."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    text = st.one_of(st.text(max_size=12), st.sampled_from(["get_weather", "f", "\ud800", "a b", "x" * 65]))
    junk = st.recursive(
        st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), text),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3),
        max_leaves=8,
    )
    function = st.fixed_dictionaries(
        {"name": st.one_of(text, junk)},
        optional={"description": junk, "parameters": st.one_of(st.just(WEATHER), junk), "strict": junk},
    )
    tool = st.one_of(
        st.fixed_dictionaries({"type": st.sampled_from(["function", "custom"]), "function": function}), junk
    )
    choice = st.one_of(
        st.sampled_from(["none", "auto", "required", "any"]),
        st.sampled_from(["auto", "required"]),
        junk,
        st.fixed_dictionaries(
            {"type": st.just("function"), "function": st.fixed_dictionaries({"name": st.one_of(text, junk)})}
        ),
    )
    call = st.one_of(
        junk,
        st.fixed_dictionaries(
            {
                "id": st.one_of(text, junk),
                "function": st.fixed_dictionaries(
                    {"name": st.one_of(text, junk), "arguments": st.one_of(st.just('{"a": 1}'), text, junk)}
                ),
            },
            optional={"type": st.one_of(st.just("function"), junk)},
        ),
    )
    message = st.one_of(
        st.sampled_from(CONVERSATION),
        st.fixed_dictionaries(
            {"role": st.sampled_from(["assistant", "tool", "user"])},
            optional={
                "content": st.one_of(text, st.none(), junk),
                "tool_call_id": st.one_of(text, junk),
                "tool_calls": st.one_of(st.lists(call, max_size=2), junk),
            },
        ),
    )
    body = st.fixed_dictionaries(
        {"messages": st.lists(message, min_size=1, max_size=3)},
        optional={
            "tools": st.one_of(st.just(TOOLS), st.lists(tool, max_size=3), junk),
            "tool_choice": choice,
            "parallel_tool_calls": st.one_of(st.booleans(), junk),
        },
    )

    @settings(max_examples=400, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
    @given(body)
    def one(fields):
        try:
            parsed = parse_chat_request(fields, tokenizer, MODEL, CONTEXT)
        except OpenAIError as e:
            assert e.status_code == 400 and e.param
            return
        if tool_names(parsed) is not None:
            format_chat_response(parsed, [completion(tokenizer, "a " + CALL)], tokenizer, "x", 0)

    one()
