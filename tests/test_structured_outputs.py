"""Structured outputs through the disaggregated stack: real prefill and decode servers (overlap on
and off) and the router, driven by the official openai client. The models have random weights, so
only the grammar can make their outputs parse and validate: the prefill server samples the first
token under it, the decode server the rest (its matcher advanced by that first token)."""

import json

import jsonschema
import openai
import psutil
import pydantic
import pytest

from pdserve.common.startup import READY, read_phases
from pdserve.common.types import SamplingParams
from tests.router_stack import RouterProcess
from tests.test_servers import Server

# Nested objects, enums, bounded arrays, ranged numbers, required and optional fields; strings are
# bounded so that a random model's string ends before max_tokens.
SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "role": {"enum": ["admin", "user", "guest"]},
            "email": {"type": "string", "maxLength": 8},  # optional
        },
        "required": ["name", "age", "role"],
    },
    "nested": {
        "type": "object",
        "properties": {
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": -10, "maximum": 10},
                    "y": {"type": "integer", "minimum": -10, "maximum": 10},
                },
                "required": ["x", "y"],
            },
            "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3},
            "ok": {"type": "boolean"},
        },
        "required": ["point", "tags", "ok"],
    },
    "scores": {
        "type": "array",
        "items": {"type": "integer", "minimum": 1, "maximum": 5},
        "minItems": 2,
        "maxItems": 4,
    },
    "flag": {
        "type": "object",
        "properties": {"level": {"enum": [1, 2, 3]}, "note": {"type": "null"}},
        "required": ["level", "note"],
    },
}
PROMPTS = ["Describe someone.", "Pick a point", "hello world, how are you", "Rate these"]


@pytest.fixture(scope="module", params=["overlap", "serial"])
def servers(request, tiny_models, tmp_path_factory):
    """(model, prefill, decode, at_ready): a prefill and a decode server (overlap on or off) as a server
    starts by default, structured output made during start-up; `at_ready`: role -> (the start-up phases
    it reported, its grammar worker processes), taken once both were ready, before any request."""
    model = tiny_models("llama")
    flags = () if request.param == "overlap" else ("--disable-overlap-schedule",)
    # NOTE: a server's first grammar compiles for 7-9 s on a 2-core CPU box, and the test servers' 10 s KV
    # transfer timeout then failed the first structured request whenever the other test worker was busy
    # (a 502 "KV transfer timed out"); these tests check the outputs, not that bound (test_servers.py does).
    flags += ("--kv-transfer-timeout", "60")
    reports = tmp_path_factory.mktemp("startup")
    prefill, decode = (
        Server(role, model, *flags, "--startup-report", str(reports / role), warm_grammars=True)
        for role in ("prefill", "decode")
    )
    try:
        prefill.wait_ready()
        decode.wait_ready()
        at_ready = {
            s.role: (read_phases(str(reports / s.role)), grammar_workers(s.proc.pid)) for s in (prefill, decode)
        }
        yield model, prefill, decode, at_ready
    finally:
        prefill.stop()
        decode.stop()


def grammar_workers(pid: int) -> list[psutil.Process]:
    """The grammar worker processes under process `pid` (a server: its scheduler process's children)."""
    return [p for p in psutil.Process(pid).children(recursive=True) if p.name() == "pdserve-grammar"]


@pytest.fixture(scope="module")
def stack(servers):
    """(model, client): the servers behind the router, driven by the openai client."""
    model, prefill, decode, _ = servers
    router = RouterProcess(model, [prefill], [decode])
    try:
        router.wait_ready()
        yield model, openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", timeout=120, max_retries=0)
    finally:
        router.stop()


def test_structured_output_is_ready_before_the_servers_are(servers):
    """Each server made structured output's machinery during its start-up (phase "grammars", before
    "ready"): its grammar worker runs before any request, so the first one pays only its own compile."""
    _, _, _, at_ready = servers
    for role, (phases, workers) in at_ready.items():
        names = [p["phase"] for p in phases]
        assert "grammars" in names and names.index("grammars") < names.index(READY), (role, names)
        assert len(workers) == 1 and workers[0].is_running(), (role, workers)
        # forked from the scheduler process with torch imported, not spawned (common/engine/grammar_prefork.py)
        assert workers[0].cmdline() == workers[0].parent().cmdline(), (role, workers[0].cmdline())


def test_greedy_structured_output_equals_the_offline_engines(stack, make_engine):
    """Through warm servers (prefill samples the first token, decode the rest), greedy output under a
    grammar is the offline engine's, whose machinery is made on the first grammar request."""
    model, client = stack
    grammar = ("json_schema", json.dumps(SCHEMAS["person"]))
    prompt = [5, 6, 7, 8]
    out = client.completions.create(
        model=model, prompt=prompt, max_tokens=60, temperature=0, extra_body={"guided_json": SCHEMAS["person"]}
    )
    [offline] = make_engine("llama").generate(
        [prompt], [SamplingParams(max_new_tokens=60, temperature=0, grammar=grammar)]
    )
    assert out.choices[0].text == offline.text
    jsonschema.validate(json.loads(offline.text), SCHEMAS["person"])


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_outputs_parse_and_validate(stack, name):
    model, client = stack
    schema = SCHEMAS[name]
    response_format = {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
    for i, prompt in enumerate(PROMPTS):
        sampled = dict(temperature=1.0, seed=i) if i % 2 else dict(temperature=0)
        out = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=120,
            response_format=response_format,
            n=2,
            **sampled,
        )
        for choice in out.choices:
            assert choice.finish_reason == "stop", (name, choice.message.content)
            jsonschema.validate(json.loads(choice.message.content), schema)


def test_vllm_guided_fields_on_both_endpoints(stack):
    model, client = stack
    out = client.completions.create(
        model=model,
        prompt="Pick one",
        max_tokens=20,
        temperature=1.0,
        seed=5,
        n=4,
        extra_body={"guided_choice": ["yes", "no", 'maybe "so"']},
    )
    assert {c.text for c in out.choices} <= {"yes", "no", 'maybe "so"'}
    out = client.completions.create(
        model=model, prompt="An id:", max_tokens=20, temperature=0, extra_body={"guided_regex": "[a-f0-9]{4}-[0-9]{2}"}
    )
    text = out.choices[0].text
    assert len(text) == 7 and text[4] == "-" and out.choices[0].finish_reason == "stop", text
    out = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=80,
        temperature=0,
        extra_body={"structured_outputs": {"json": SCHEMAS["flag"]}},
    )
    jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMAS["flag"])
    out = client.completions.create(
        model=model,
        prompt="x",
        max_tokens=60,
        temperature=0,
        extra_body={"guided_grammar": 'root ::= "(" [a-z]{1,4} ("," [a-z]{1,4})? ")"'},
    )
    assert out.choices[0].text.startswith("(") and out.choices[0].text.endswith(")"), out.choices[0].text


def test_streamed_output_equals_the_non_streamed_one(stack):
    model, client = stack
    kwargs = dict(
        model=model,
        messages=[{"role": "user", "content": "Stream it"}],
        max_tokens=120,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMAS["nested"]}},
    )
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = client.chat.completions.create(stream=True, **kwargs)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
    jsonschema.validate(json.loads(whole), SCHEMAS["nested"])


class Point(pydantic.BaseModel):
    x: int = pydantic.Field(ge=-100, le=100)
    y: int = pydantic.Field(ge=-100, le=100)
    label: str = pydantic.Field(max_length=6)


def test_the_openai_clients_parse_with_a_pydantic_model(stack):
    model, client = stack
    out = client.chat.completions.parse(
        model=model,
        messages=[{"role": "user", "content": "A point, please"}],
        max_tokens=80,
        temperature=0,
        response_format=Point,
    )
    point = out.choices[0].message.parsed
    assert isinstance(point, Point) and -100 <= point.x <= 100


def test_json_object_output_is_json_as_far_as_it_goes(stack):
    """response_format json_object: any JSON. A random model rarely closes an unbounded object in
    a few tokens, so a cut output is checked as a prefix the JSON grammar accepts."""
    import xgrammar

    from pdserve.common.tokenizer import load_tokenizer

    model, client = stack
    out = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "JSON"}],
        max_tokens=40,
        temperature=0,
        response_format={"type": "json_object"},
    )
    choice = out.choices[0]
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content), (dict, list))
    tokenizer = load_tokenizer(model)
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer)
    matcher = xgrammar.GrammarMatcher(xgrammar.GrammarCompiler(info).compile_builtin_json_grammar())
    assert matcher.accept_string(choice.message.content), choice.message.content


def test_requests_without_a_grammar_are_unchanged_beside_ones_with_one(stack):
    """A plain greedy request gives the same tokens alone and next to grammar requests."""
    import concurrent.futures

    model, client = stack

    def plain():
        return (
            client.completions.create(
                model=model, prompt="The same words", max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
            )
            .choices[0]
            .text
        )

    def constrained(i):
        return (
            client.completions.create(
                model=model,
                prompt=f"prompt {i}",
                max_tokens=60,
                temperature=0,
                extra_body={"guided_json": SCHEMAS["person"]},
            )
            .choices[0]
            .text
        )

    alone = plain()
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        others = [pool.submit(constrained, i) for i in range(5)]
        beside = pool.submit(plain)
        for f in others:
            jsonschema.validate(json.loads(f.result()), SCHEMAS["person"])
        assert beside.result() == alone


@pytest.mark.parametrize(
    "body, problem",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
            "cannot be compiled",
        ),
        ({"guided_regex": "([a-z"}, "cannot be compiled"),
        ({"guided_grammar": "root ::= "}, "cannot be compiled"),
        ({"response_format": {"type": "xml"}}, "must be one of text, json_object, json_schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "name' is required"),
        ({"guided_json": {"type": "object"}, "guided_regex": "a+"}, "at most one structured-output constraint"),
        ({"guided_choice": []}, "non-empty array"),
        ({"guided_decoding_backend": "outlines", "guided_regex": "a"}, "this server uses xgrammar"),
    ],
)
def test_bad_grammars_get_a_400_that_says_why(stack, body, problem):
    model, client = stack
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "x"}], max_tokens=5, extra_body=body
        )
    assert problem in str(bad.value)


@pytest.mark.parametrize(
    "tool_choice, only",
    [
        ("required", None),
        ({"type": "function", "function": {"name": "get_weather"}}, "get_weather"),
    ],
)
def test_forced_tool_calls_through_the_openai_client_streamed_and_not(stack, tool_choice, only):
    """tool_choice "required" or a named function: the grammar makes the whole answer calls of the
    given tools, so even random weights give message.tool_calls; the stream carries the same calls."""
    from tests.test_tool_calls import TOOLS, check_forced_answer, merge_stream

    model, client = stack
    for parallel in (False, True):
        kwargs = dict(
            model=model,
            messages=[{"role": "user", "content": "The weather in Paris?"}],
            tools=TOOLS,
            tool_choice=tool_choice,
            parallel_tool_calls=parallel,
            max_tokens=200,
            temperature=1.0,
            seed=int(parallel),
            n=2,
        )
        out = client.chat.completions.create(**kwargs)
        streamed = merge_stream([chunk.model_dump() for chunk in client.chat.completions.create(stream=True, **kwargs)])
        for i, choice in enumerate(out.choices):
            check_forced_answer(choice.message.model_dump(), choice.finish_reason, TOOLS, only=only, parallel=parallel)
            check_forced_answer(streamed[i], streamed[i]["finish_reason"], TOOLS, only=only, parallel=parallel)
            assert [c["function"] for c in streamed[i]["tool_calls"]] == [
                c.function.model_dump() for c in choice.message.tool_calls
            ]


def test_a_forced_tool_call_needs_tools_and_no_other_grammar(stack):
    from tests.test_tool_calls import TOOLS

    model, client = stack
    messages = [{"role": "user", "content": "x"}]
    with pytest.raises(openai.BadRequestError, match="requires 'tools'"):
        client.chat.completions.create(model=model, messages=messages, tool_choice="required", max_tokens=5)
    with pytest.raises(openai.BadRequestError, match="cannot combine"):
        client.chat.completions.create(
            model=model,
            messages=messages,
            tools=TOOLS,
            tool_choice="required",
            max_tokens=5,
            response_format={"type": "json_object"},
        )
