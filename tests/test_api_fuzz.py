"""The OpenAI API fuzzed against a real router and real servers (tiny model).

Hypothesis builds request bodies for /v1/completions, /v1/chat/completions, /v1/responses, /generate,
/tokenize and /detokenize: valid and
invalid types, out-of-range numbers (past the wire's uint32/int32/int64), unicode (lone surrogates
too), empty and huge lists, nested junk, unknown fields, streaming on and off, and bytes that are
not JSON at all. For every body:
- no 5xx (and no in-band error in a 200 stream): nothing a client sends is the servers' fault;
- every 4xx carries OpenAI's error body;
- a normal request right after it succeeds within 2 s.
At the end the router has blamed no server (no circuit opened) and both servers' KV is idle.

The run is derandomized (the same bodies every time) and bounded: a few hundred bodies, generation
kept to a few tokens per choice.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from tests.router_stack import RouterProcess, openai_error_problem, send
from tests.test_servers import Server, wait_idle

EXAMPLES = 600
# A normal request after each case must answer within this (the suite runs two test files at once on
# 2 cores: a probe can wait seconds behind the other file's servers; a wedged router never answers).
PROBE_S = 10.0

# ---- values ---------------------------------------------------------------------------------------

EDGES = [
    0,
    -1,
    1,
    2**31 - 1,
    2**31,
    2**32 - 1,
    2**32,
    2**63 - 1,
    2**63,
    2**64 - 1,
    2**64,
    -(2**31) - 1,
    -(2**63),
    -(2**63) - 1,
    10**12,
    10**30,
    -(10**30),
]
INTS = st.one_of(st.sampled_from(EDGES), st.sampled_from(EDGES), st.integers(-3, 8), st.integers())
# Every code point, lone surrogates included (json.dumps escapes them; json.loads lets them through).
TEXT = st.one_of(
    st.text(st.characters(exclude_categories=()), max_size=24),
    st.sampled_from(["\ud800", "a\udfffb", "\x00", "<|im_start|>", "</s>", "\u202e", "\U0001f642" * 5]),
)
LEAVES = st.one_of(st.none(), st.booleans(), INTS, st.floats(), TEXT)  # floats: NaN and Infinity too
JUNK = st.recursive(
    LEAVES, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4), max_leaves=12
)


def mostly(valid):
    """`valid` two times in three, anything else the third."""
    return st.one_of(valid, valid, JUNK)


# ---- bodies: valid (in range), careless (the right types, at and past the edges), junk (anything) --

VOCAB = 512  # the tiny model's
GOOD_TEXT = st.text(st.characters(exclude_categories=("Cs",)), min_size=1, max_size=24)
GOOD_IDS = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8)
TOKEN_ID = st.one_of(st.integers(0, VOCAB + 100), INTS)
HUGE_LISTS = st.one_of(
    st.sampled_from([257, 300, 5000]).map(lambda k: ["hi"] * k),  # beyond the fan-out limit
    st.sampled_from([257, 5000]).map(lambda k: [[1, 2]] * k),
    st.just([[]] * 50),
    st.just([""] * 50),
    st.just(["hi"] * 49 + [7]),
    st.sampled_from([1025, 20000]).map(lambda k: [1] * k),  # beyond the context
    st.sampled_from([5000, 200000]).map(lambda k: "a " * k),
)
# Never null: an absent max_tokens is the rest of the context, too long a generation for this test.
MAX_TOKENS = {
    "valid": st.integers(1, 4),
    "careless": st.one_of(st.integers(1, 4), st.sampled_from([0, -1, 1024, 2**32, 10**12, "4", 2.0, True, []])),
}
PROMPT = {
    "valid": st.one_of(
        GOOD_TEXT, st.lists(GOOD_TEXT, min_size=1, max_size=4), GOOD_IDS, st.lists(GOOD_IDS, min_size=1, max_size=3)
    ),
    "careless": st.one_of(
        TEXT,
        st.lists(TEXT, max_size=4),
        st.lists(TOKEN_ID, max_size=8),
        st.lists(st.lists(TOKEN_ID, max_size=6), max_size=3),
        HUGE_LISTS,
    ),
}
SAMPLING = {  # name: (valid, careless)
    "model": (st.just("fuzz-model"), st.sampled_from(["fuzz-model", "gpt-4o", ""])),
    "temperature": (st.floats(0, 2), st.floats()),
    "top_p": (st.floats(0, 1, exclude_min=True), st.floats()),
    "top_k": (st.integers(-1, 50) | st.just(2**31 - 1), INTS),
    "min_p": (st.floats(0, 1), st.floats()),
    "repetition_penalty": (st.floats(0, 2, exclude_min=True), st.floats()),
    "frequency_penalty": (st.floats(-2, 2), st.floats()),
    "presence_penalty": (st.floats(-2, 2), st.floats()),
    "n": (st.integers(1, 3), INTS),
    "seed": (st.integers(-(2**63), 2**64 - 1), INTS),
    "stop": (
        st.lists(GOOD_TEXT, max_size=3),
        st.one_of(TEXT, st.lists(TEXT, max_size=3), st.just(["x" * 100_000]), st.just(["s"] * 1000)),
    ),
    "stop_token_ids": (st.lists(st.integers(0, VOCAB - 1), max_size=4), st.lists(TOKEN_ID, max_size=4)),
    "min_tokens": (st.integers(0, 1), INTS),
    "ignore_eos": (st.booleans(), st.booleans()),
    "skip_special_tokens": (st.booleans(), st.booleans()),
    "include_stop_str_in_output": (st.booleans(), st.booleans()),
    "return_token_ids": (st.booleans(), st.booleans()),
    "stream": (st.booleans(), st.booleans()),
    "stream_options": (
        st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
        st.fixed_dictionaries({}, optional={"include_usage": st.booleans(), "other": st.booleans()}),
    ),
    "user": (GOOD_TEXT, TEXT),
}
# Well-formed, but the grammar engine refuses it: the servers answer 400.
BAD_SCHEMA = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}
COMPLETION_ONLY = {
    "logprobs": (st.integers(0, 5), st.integers(-1, 6)),
    "echo": (st.booleans(), st.booleans()),
    "best_of": (st.just(1), INTS),
}
CHAT_ONLY = {
    "max_completion_tokens": (MAX_TOKENS["valid"], MAX_TOKENS["careless"]),
    "logprobs": (st.booleans(), st.booleans()),
    "top_logprobs": (st.integers(0, 20), st.integers(-1, 21)),
    "response_format": (
        st.sampled_from([{"type": "text"}, {"type": "json_object"}]),
        st.one_of(st.sampled_from([{"type": "xml"}, {"type": "json_schema"}, BAD_SCHEMA]), JUNK),
    ),
    "tool_choice": (st.just("none"), st.just("auto")),
}
# Fields that only a junk body sets (they are unsupported or ignored).
JUNK_ONLY = {"logit_bias": JUNK, "metadata": JUNK, "suffix": JUNK, "tools": JUNK, "functions": JUNK}
EXTRA_FIELDS = st.dictionaries(TEXT, JUNK, max_size=2)


def valid(spec: dict) -> dict:
    return {name: strategy for name, (strategy, _) in spec.items()}


def careless(spec: dict) -> dict:
    return {name: strategy for name, (_, strategy) in spec.items()}


PART = st.fixed_dictionaries({"type": st.just("text"), "text": GOOD_TEXT})
MESSAGES = (
    st.lists(
        st.fixed_dictionaries(
            {
                "role": st.sampled_from(["system", "developer", "user", "assistant"]),
                "content": st.one_of(GOOD_TEXT, st.lists(PART, min_size=1, max_size=3)),
            },
            optional={"name": GOOD_TEXT},
        ),
        min_size=1,
        max_size=4,
    ),
    st.lists(
        st.fixed_dictionaries(
            {
                "role": st.one_of(st.sampled_from(["system", "user", "tool", "wizard"]), JUNK),
                "content": st.one_of(TEXT, st.lists(st.one_of(PART, JUNK), max_size=3), JUNK),
            },
            optional={"name": st.one_of(TEXT, JUNK), "tool_calls": JUNK},
        ),
        max_size=4,
    ),
)
# Every field a body of each endpoint may have: (valid values, careless values).
ENDPOINT_FIELDS = {
    "/v1/completions": {"prompt": (PROMPT["valid"], PROMPT["careless"]), **SAMPLING, **COMPLETION_ONLY},
    "/v1/chat/completions": {"messages": MESSAGES, **SAMPLING, **CHAT_ONLY},
    # /generate: sampling_params hold the completion fields; n and model are not its own
    "/generate": {
        name: spec for name, spec in SAMPLING.items() if name not in ("n", "model", "stream", "stream_options")
    },
    "/v1/responses": {
        "input": (st.one_of(GOOD_TEXT, MESSAGES[0]), st.one_of(TEXT, MESSAGES[1], st.lists(JUNK, max_size=3))),
        "instructions": (GOOD_TEXT, TEXT),
        "model": SAMPLING["model"],
        "temperature": SAMPLING["temperature"],
        "top_p": SAMPLING["top_p"],
        "stream": SAMPLING["stream"],
        "text": (
            st.sampled_from([{"format": {"type": "text"}}, {"format": {"type": "json_object"}}]),
            st.one_of(st.sampled_from([{"format": {"type": "xml"}}, {"format": BAD_SCHEMA | {"name": "x"}}]), JUNK),
        ),
        "tool_choice": (st.just("none"), st.sampled_from(["auto", "required", {"type": "function", "name": "f"}])),
        "previous_response_id": (st.none(), TEXT),
    },
    # the tokenizer's endpoints: no generation (no max_tokens), no server asked
    "/tokenize": {
        "model": SAMPLING["model"],
        "prompt": (GOOD_TEXT, st.one_of(TEXT, HUGE_LISTS)),
        "messages": MESSAGES,
        "add_special_tokens": (st.booleans(), st.booleans()),
        "add_generation_prompt": (st.booleans(), st.booleans()),
        "continue_final_message": (st.just(False), st.booleans()),
        "return_token_strs": (st.booleans(), st.booleans()),
    },
    "/detokenize": {
        "model": SAMPLING["model"],
        "tokens": (GOOD_IDS, st.one_of(st.lists(TOKEN_ID, max_size=8), HUGE_LISTS)),
    },
}
REQUIRED = {
    "/v1/completions": ("prompt",),
    "/v1/chat/completions": ("messages",),
    "/v1/responses": ("input",),
    "/generate": (),
    "/tokenize": (),
    "/detokenize": ("tokens",),
}
# the field that bounds each generating endpoint's answer (never absent: the rest of the context is too long)
LIMIT = {
    "/v1/completions": "max_tokens",
    "/v1/chat/completions": "max_tokens",
    "/generate": "max_tokens",
    "/v1/responses": "max_output_tokens",
}


def stream_rules(body: dict) -> dict:
    """A valid body asks for stream_options only when it streams."""
    if not body.get("stream"):
        body.pop("stream_options", None)
    return body


@st.composite
def body_of(draw, path: str, kind: str) -> dict:
    """A valid body for `path`; a careless one has one or two fields set to values of their type
    that may be out of range, a junk one to anything (and may carry unknown fields)."""
    spec = ENDPOINT_FIELDS[path]
    required = {name: spec[name] for name in REQUIRED[path]}
    optional = {name: pair for name, pair in spec.items() if name not in required}
    limit = {LIMIT[path]: MAX_TOKENS} if path in LIMIT else {}
    fields = draw(
        st.fixed_dictionaries(valid(required) | {k: v["valid"] for k, v in limit.items()}, optional=valid(optional))
    )
    if kind != "valid":
        changed = draw(st.lists(st.sampled_from(sorted(spec) + list(limit)), min_size=1, max_size=2, unique=True))
        wild = careless(spec) | {k: v["careless"] for k, v in limit.items()}
        for name in changed:
            fields[name] = draw(wild[name] if kind == "careless" else st.one_of(wild[name], JUNK))
        if kind == "junk":
            fields |= draw(st.fixed_dictionaries({}, optional=JUNK_ONLY)) | draw(EXTRA_FIELDS)
    else:
        fields = stream_rules(fields)
    if path != "/generate":
        return fields
    # /generate: one prompt as text or token ids, the rest in sampling_params (a junk body may give both)
    prompt = draw(st.one_of(st.fixed_dictionaries({"text": GOOD_TEXT}), st.fixed_dictionaries({"input_ids": GOOD_IDS})))
    if kind != "valid":
        prompt = draw(
            st.sampled_from(
                [
                    prompt,
                    {"text": draw(TEXT)},
                    {"input_ids": draw(st.lists(TOKEN_ID, max_size=8))},
                    prompt | {"text": "x"},
                    {},
                ]
            )
        )
    return prompt | {
        "sampling_params": fields if kind != "junk" else draw(st.one_of(st.just(fields), JUNK)),
        "stream": draw(st.booleans()),
    }


NOT_JSON = st.one_of(
    st.binary(max_size=40),
    st.sampled_from(
        [
            b"",
            b"[" * 100_000,
            b'{"prompt": ' * 50_000,
            b"\xff\xfe{}",
            b'{"prompt": "x", "max_tokens": 1',
            b"null",
            b"[]",
            b'"x"',
            b"1e999999",
            b'{"prompt": "\\ud800", "max_tokens": 1}',
        ]
    ),
)


PATHS = ["/v1/completions", "/v1/chat/completions", "/v1/responses", "/generate", "/tokenize", "/detokenize"]


def case():
    """(path, body): a dict sent as JSON (valid, careless or junk), or raw bytes; a quarter of each."""
    path = st.sampled_from(PATHS)
    return st.one_of(
        *(
            path.flatmap(lambda p, kind=kind: st.tuples(st.just(p), body_of(p, kind)))
            for kind in ("valid", "careless", "junk")
        ),
        st.tuples(path, NOT_JSON),
    )


# ---- the stack ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stack(tiny_models):
    model = tiny_models("llama")
    decode, prefill = Server("decode", model), Server("prefill", model)
    router = None
    try:
        decode.wait_ready()
        prefill.wait_ready()
        router = RouterProcess(model, [prefill], [decode], "--served-model-name", "fuzz-model")
        router.wait_ready()
        yield router, decode, prefill
    finally:
        if router is not None:
            router.stop()
        decode.stop()
        prefill.stop()


PROBE = {"prompt": "hello", "max_tokens": 1, "temperature": 0}


def problems_of(router: RouterProcess, path: str, body) -> list[str]:
    """What is wrong with the router's answer to one body, and with a normal request after it."""
    found = []
    try:
        answer = send(router.url, path, body)
    except Exception as e:  # noqa: BLE001 (a dropped connection or a timeout is a finding)
        answer, found = None, [f"no answer: {type(e).__name__}: {e}"]
    if answer is not None:
        if answer.status >= 500:
            found.append(f"{answer.status}: {answer.raw[:200]!r}")
        elif answer.status >= 400:
            if (problem := openai_error_problem(answer)) is not None:
                found.append(problem)
        elif answer.events is not None and path == "/v1/responses":  # typed events, no [DONE]
            kinds = [e.get("type") for e in answer.events if isinstance(e, dict)]
            if "error" in kinds or "response.failed" in kinds:
                found.append(f"error in a 200 stream: {answer.raw[-300:]!r}")
            elif not kinds or kinds[-1] not in ("response.completed", "response.incomplete"):
                found.append(f"stream did not end with response.completed: {answer.raw[-200:]!r}")
        elif answer.events is not None:
            errors = [e for e in answer.events if isinstance(e, dict) and "error" in e]
            if errors:
                found.append(f"error in a 200 stream: {errors[0]}")
            elif not answer.events or answer.events[-1] != "[DONE]":
                found.append(f"stream did not end with [DONE]: {answer.raw[-200:]!r}")
        elif not isinstance(answer.json, dict):
            found.append(f"200 without a JSON object: {answer.raw[:200]!r}")
    started = time.monotonic()
    try:
        probe = send(router.url, "/v1/completions", PROBE, timeout=30)
        took = time.monotonic() - started
        if probe.status != 200 or took > PROBE_S:
            found.append(f"a normal request after it: {probe.status} in {took:.1f}s: {probe.raw[:150]!r}")
    except Exception as e:  # noqa: BLE001
        found.append(f"a normal request after it: {type(e).__name__}: {e}")
    return found


FUZZ_SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    phases=(Phase.explicit, Phase.generate),  # shrinking against a live stack would mislead
    suppress_health_check=list(HealthCheck),
)


def test_no_body_gets_a_5xx_or_breaks_the_service(stack):
    router, decode, prefill = stack
    started = time.monotonic()

    @FUZZ_SETTINGS
    @given(case())
    @example(("/v1/completions", {"prompt": ["hi"] * 5000, "max_tokens": 1}))  # the measured cases
    @example(("/v1/completions", {"prompt": "hi", "max_tokens": 1, "stop_token_ids": [1000000000000]}))
    def one(path_and_body):
        path, body = path_and_body
        found = problems_of(router, path, body)
        shown = body[:200] if isinstance(body, bytes) else json.dumps(body)[:500]
        assert not found, f"POST {path} {shown!r}:\n" + "\n".join(found)

    one()
    print(f"{EXAMPLES} bodies in {time.monotonic() - started:.0f}s")
    assert router.worker_errors() == {prefill.address: 0.0, decode.address: 0.0}, (
        "a client's body was blamed on a server"
    )
    assert router.unhealthy() == []
    asyncio.run(wait_idle(decode, prefill))
