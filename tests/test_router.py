"""The router through `pdserve up` (real processes: router, prefill server, decode server), driven
by the official `openai` client."""

import json
import re
import urllib.error
import urllib.request

import jsonschema
import openai
import pytest
import torch

from pdserve.common.config import short_model_name
from pdserve.common.tokenizer import load_tokenizer
from tests.router_stack import pdserve_up


@pytest.fixture(scope="module")
def receiver():
    """An OTLP/gRPC collector (bench/micro/otlp_sink.py) that `pdserve up` below traces to."""
    from pdserve.bench.micro.otlp_sink import start_receiver
    from pdserve.common.ports import free_port

    port = free_port()
    collector, server = start_receiver(port)
    yield collector, f"http://127.0.0.1:{port}"
    server.stop(None)


@pytest.fixture(scope="module")
def up(tiny_models, receiver):
    """`pdserve up`, tracing to `receiver`: (model, router port, client, the line that says it is up)."""
    model = tiny_models("qwen3")
    proc, port, line = pdserve_up(model, "--prefill-policy", "cache_aware", "--otlp-traces-endpoint", receiver[1])
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=120)
    yield model, port, client, line
    proc.send_signal(2)  # Ctrl-C
    proc.wait(90)
    assert proc.returncode == 0


@pytest.fixture(scope="module")
def deployment(up):
    return up[:3]


def test_the_servers_require_the_secret_pdserve_up_made(up):
    """Secure by default: `pdserve up` gives every process a fresh cluster secret, so its servers
    answer nobody but its router (and health checks)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from pdserve.proto import pdserve_pb2 as pb
    from pdserve.proto import pdserve_pb2_grpc as pb_grpc

    servers = re.search(r"prefill (\S+); decode (\S+)\)", up[3])
    for address, stub in zip(servers.groups(), (pb_grpc.PrefillServiceStub, pb_grpc.DecodeServiceStub)):
        with grpc.insecure_channel(address) as channel:
            with pytest.raises(grpc.RpcError) as refused:
                stub(channel).GetAgentMetadata(pb.GetAgentMetadataRequest(), timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_models_and_readiness(deployment):
    model, port, client = deployment
    # served under the checkpoint's short name (the path as given is accepted too: the other tests use it)
    assert [m.id for m in client.models.list().data] == [short_model_name(model)]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/readiness", timeout=10) as r:
        assert json.loads(r.read())["ready"] is True


def test_greedy_completions_through_the_router_match_transformers(deployment):
    from transformers import AutoModelForCausalLM

    model, _, client = deployment
    prompts = [[0, 11, 22, 33], [0] + list(range(40, 90)), [0, 7]]
    hf = AutoModelForCausalLM.from_pretrained(model, attn_implementation="eager", dtype=torch.float32).eval()
    for ids in prompts:
        with torch.no_grad():
            want = hf.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False, pad_token_id=2)[
                0, len(ids) :
            ].tolist()
        out = client.completions.create(
            model=model, prompt=ids, max_tokens=10, temperature=0, extra_body={"return_token_ids": True}
        )
        assert out.choices[0].model_extra["token_ids"] == want
        assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == len(want)


def test_chat_streaming_equals_non_streaming_and_reports_usage(deployment):
    model, _, client = deployment
    messages = [{"role": "user", "content": "Tell me a story."}]
    full = client.chat.completions.create(model=model, messages=messages, max_tokens=20, temperature=0)
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        full.choices[0].finish_reason
    ]
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_n_seeds_and_stop_strings(deployment):
    model, _, client = deployment
    out = client.completions.create(model=model, prompt="Once upon", max_tokens=12, temperature=1.0, n=3, seed=5)
    again = client.completions.create(model=model, prompt="Once upon", max_tokens=12, temperature=1.0, n=3, seed=5)
    assert [c.text for c in out.choices] == [c.text for c in again.choices]
    assert len({c.text for c in out.choices}) > 1
    free = client.completions.create(model=model, prompt="Once upon", max_tokens=16, temperature=0).choices[0].text
    stop = next(
        free[i : i + 2] for i in range(2, len(free) - 2) if free[i : i + 2].strip() and "\ufffd" not in free[i : i + 2]
    )
    cut = client.completions.create(model=model, prompt="Once upon", max_tokens=16, temperature=0, stop=[stop])
    assert cut.choices[0].text == free[: free.index(stop)] and cut.choices[0].finish_reason == "stop"
    # Streamed, with a stop string that spans two tokens, the deltas add up to the same cut text:
    # the first token's part of the stop string is never sent.
    ids = (
        client.completions.create(
            model=model, prompt="Once upon", max_tokens=16, temperature=0, extra_body={"return_token_ids": True}
        )
        .choices[0]
        .model_extra["token_ids"]
    )
    tokenizer = load_tokenizer(model)
    ends = [len(tokenizer.decode(ids[:k])) for k in range(1, len(ids))]  # where each token's text ends
    spanning = [
        free[b - 1 : b + 1]
        for b in ends
        if 0 < b < len(free) - 1
        and free[b - 1 : b + 1].strip()
        and "\ufffd" not in free[b - 1 : b + 1]
        and free.index(free[b - 1 : b + 1]) == b - 1
    ]
    assert spanning, "no stop string spans two tokens of this answer"
    cut = client.completions.create(model=model, prompt="Once upon", max_tokens=16, temperature=0, stop=[spanning[0]])
    chunks = list(
        client.completions.create(
            model=model, prompt="Once upon", max_tokens=16, temperature=0, stop=[spanning[0]], stream=True
        )
    )
    assert (
        "".join(c.choices[0].text for c in chunks if c.choices)
        == cut.choices[0].text
        == free[: free.index(spanning[0])]
    )


def test_bad_requests_get_openai_errors(deployment):
    model, port, client = deployment
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="other-model", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=model, prompt="x", max_tokens=2, temperature=5)
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model=model, messages=[], max_tokens=2)
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", data=b"{not json", headers={"Content-Type": "application/json"}
    )
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(request, timeout=10)
    assert e.value.code == 400 and "not valid JSON" in e.value.read().decode()
    # and the deployment still serves
    assert (
        client.completions.create(model=model, prompt="x", max_tokens=2, temperature=0).choices[0].finish_reason
        == "length"
    )


def test_logprobs_come_through_the_router(deployment):
    model, _, client = deployment
    out = client.completions.create(model=model, prompt="Hello", max_tokens=5, temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == 5 and len(lp.token_logprobs) == 5 and all(v <= 0 for v in lp.token_logprobs)
    assert all(len(top) >= 2 for top in lp.top_logprobs)
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    assert len(chat.choices[0].logprobs.content) == 4 and len(chat.choices[0].logprobs.content[0].top_logprobs) == 3


def test_streamed_logprobs_include_the_token_that_stopped_it(deployment):
    """A stop id (like an EOS) adds no text, but its logprob is reported streamed as unstreamed."""
    model, _, client = deployment
    free = client.completions.create(
        model=model,
        prompt="Hello",
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    ids = free.choices[0].model_extra["token_ids"]
    stop_id = ids[3]
    kwargs = dict(
        model=model,
        prompt="Hello",
        max_tokens=8,
        temperature=0,
        logprobs=1,
        extra_body={"ignore_eos": True, "stop_token_ids": [stop_id]},
    )
    whole = client.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "stop" and len(whole.logprobs.token_logprobs) == ids.index(stop_id) + 1
    chunks = list(client.completions.create(stream=True, **kwargs))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.token_logprobs]
    assert streamed == whole.logprobs.token_logprobs
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.text


def test_streamed_logprobs_cover_every_token(deployment):
    model, _, client = deployment
    chunks = list(
        client.completions.create(
            model=model,
            prompt="Hello",
            max_tokens=6,
            temperature=0,
            logprobs=1,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    tokens = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.token_logprobs]
    assert len(tokens) == 6 and all(v <= 0 for v in tokens)
    chat = list(
        client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=5,
            temperature=0,
            logprobs=True,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    entries = [e for c in chat if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert len(entries) == 5


def _hf_prompt_scores(model: str, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, attn_implementation="eager", dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_echo_with_logprobs_scores_the_prompt_on_the_prefill_server(deployment):
    """lm-eval's loglikelihood request: echo + logprobs, max_tokens 0 and 1; prompt logprobs equal
    transformers' log-softmax, the first prompt token's is null; and vLLM's prompt_logprobs."""
    model, _, client = deployment
    ids = [0, 11, 22, 33, 44, 55, 66, 77]
    scores = _hf_prompt_scores(model, ids)
    want = [scores[p - 1, ids[p]].item() for p in range(1, len(ids))]
    for max_tokens in (0, 1):
        out = client.completions.create(
            model=model, prompt=ids, max_tokens=max_tokens, temperature=0, echo=True, logprobs=1
        )
        lp = out.choices[0].logprobs
        assert len(lp.tokens) == len(ids) + max_tokens
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert all(abs(a - b) < 1e-4 for a, b in zip(lp.token_logprobs[1 : len(ids)], want)), (lp.token_logprobs, want)
        assert all(1 <= len(top) <= 2 for top in lp.top_logprobs[1:])
        assert out.usage.completion_tokens == max_tokens and out.choices[0].finish_reason == "length"
    out = client.completions.create(
        model=model, prompt=ids, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 2}
    )
    field = out.choices[0].model_extra["prompt_logprobs"]
    assert field[0] is None and len(field) == len(ids)
    for p in range(1, len(ids)):
        entry = field[p][str(ids[p])]
        assert abs(entry["logprob"] - want[p - 1]) < 1e-4
        assert entry["rank"] == 1 + int((scores[p - 1] > scores[p - 1, ids[p]]).sum())
        assert 2 <= len(field[p]) <= 3
    # Streamed echo: the prompt's text and logprobs lead, then the generated tokens'.
    chunks = list(
        client.completions.create(
            model=model,
            prompt=ids,
            max_tokens=3,
            temperature=0,
            echo=True,
            logprobs=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    streamed = [v for c in chunks if c.choices and c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert streamed[0] is None and len(streamed) == len(ids) + 3
    assert all(abs(a - b) < 1e-4 for a, b in zip(streamed[1 : len(ids)], want))


def test_logit_bias_reaches_both_servers(deployment):
    """The prefill server samples the first token, the decode server the rest: both apply the bias."""
    model, _, client = deployment
    out = client.completions.create(
        model=model,
        prompt="Hello",
        max_tokens=5,
        temperature=0,
        logit_bias={"17": 100},
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    assert out.choices[0].model_extra["token_ids"] == [17] * 5


def post_json(port: int, path: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_tokenize_counts_what_the_endpoints_prefill_and_detokenize_reads_it_back(deployment):
    """/tokenize's ids are exactly the prompt ids the completion and chat endpoints prefill (with
    tools, the template's own rendering of them); /detokenize gives their text back; bad bodies get
    OpenAI errors, another model 404."""
    model, port, client = deployment
    extra = {"return_token_ids": True}
    status, counted = post_json(port, "/tokenize", {"model": model, "prompt": "Hello there, tokens"})
    done = client.completions.create(model=model, prompt="Hello there, tokens", max_tokens=1, extra_body=extra)
    assert status == 200 and counted["tokens"] == done.choices[0].model_extra["prompt_token_ids"]
    assert counted["count"] == done.usage.prompt_tokens and counted["max_model_len"] > 0
    assert counted["token_strs"] is None

    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    prompts = []
    for with_tools in ({}, {"tools": tools}):
        status, counted = post_json(port, "/tokenize", {"messages": messages, "return_token_strs": True} | with_tools)
        chat = client.chat.completions.create(
            model=model, messages=messages, max_tokens=1, extra_body=extra, **with_tools
        )
        assert status == 200 and counted["tokens"] == chat.choices[0].model_extra["prompt_token_ids"]
        assert len(counted["token_strs"]) == counted["count"]
        prompts.append(counted["tokens"])
    status, open_turn = post_json(port, "/tokenize", {"messages": messages, "add_generation_prompt": False})
    assert status == 200 and prompts[0][: open_turn["count"]] == open_turn["tokens"]  # the same, less the
    assert open_turn["count"] < len(prompts[0])  # assistant turn it opens

    status, text = post_json(port, "/detokenize", {"model": model, "tokens": counted["tokens"]})
    assert status == 200 and "Hi!" in text["prompt"] and "Be brief." in text["prompt"]

    for path, body, code, words in [
        ("/tokenize", {"prompt": "x", "messages": messages}, 400, "either"),
        ("/tokenize", {"prompt": 5}, 400, "string"),
        ("/tokenize", {"prompt": "x", "tools": tools}, 400, "messages"),
        ("/tokenize", {"messages": messages, "continue_final_message": True}, 400, "both"),
        ("/tokenize", {"prompt": "x", "temperature": 0}, 400, "unknown"),
        ("/tokenize", {"model": "other", "prompt": "x"}, 404, "does not exist"),
        ("/detokenize", {"tokens": [1, -1]}, 400, "tokens[1]"),
        ("/detokenize", {"tokens": [10**9]}, 400, "token id"),
        ("/detokenize", {"tokens": "abc"}, 400, "array"),
    ]:
        status, error = post_json(port, path, body)
        assert status == code and words in error["error"]["message"], (path, body, error)


WEATHER = {
    "type": "function",
    "name": "weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]},
}


def test_the_responses_api_answers_as_the_chat_endpoint_does(deployment):
    """/v1/responses with the official client: a plain answer, its stream, json_schema via
    text.format, and a function call round trip (the call item, then function_call_output, then the
    answer); each greedy text equals the chat endpoint's for the same conversation."""
    from tests.test_structured_outputs import SCHEMAS

    model, _, client = deployment
    greedy = dict(model=model, temperature=0)

    def chat_text(messages, max_tokens, **kw):
        return client.chat.completions.create(messages=messages, max_tokens=max_tokens, **greedy, **kw).choices[0]

    plain = client.responses.create(input="Hello there", instructions="Be brief.", max_output_tokens=12, **greedy)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    chat = client.chat.completions.create(messages=messages, max_tokens=12, **greedy)
    assert plain.output_text == chat.choices[0].message.content and plain.output_text
    assert plain.status == "incomplete" if chat.choices[0].finish_reason == "length" else plain.status == "completed"
    assert (plain.usage.input_tokens, plain.usage.output_tokens) == (
        chat.usage.prompt_tokens,
        chat.usage.completion_tokens,
    )

    streamed = list(
        client.responses.create(
            input=messages[1:], instructions="Be brief.", max_output_tokens=12, stream=True, **greedy
        )
    )
    kinds = [event.type for event in streamed]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] in (
        "response.completed",
        "response.incomplete",
    )
    assert "".join(e.delta for e in streamed if e.type == "response.output_text.delta") == plain.output_text
    assert streamed[-1].response.output_text == plain.output_text and streamed[-1].response.usage.output_tokens > 0

    schema = SCHEMAS["person"]
    fmt = {"format": {"type": "json_schema", "name": "person", "schema": schema, "strict": True}}
    structured = client.responses.create(input="A person, please", text=fmt, max_output_tokens=80, **greedy)
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}
    asked = [{"role": "user", "content": "A person, please"}]
    assert structured.output_text == chat_text(asked, 80, response_format=rf).message.content
    assert structured.status == "completed"
    jsonschema.validate(json.loads(structured.output_text), schema)

    turn = [{"role": "user", "content": "Weather in Paris?"}]
    called = client.responses.create(
        input=turn, tools=[WEATHER], tool_choice="required", max_output_tokens=160, **greedy
    )
    [call] = [item for item in called.output if item.type == "function_call"]
    assert call.name == "weather" and "city" in json.loads(call.arguments)
    following = turn + [
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"},
    ]
    final = client.responses.create(input=following, tools=[WEATHER], max_output_tokens=12, **greedy)
    as_chat = turn + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
        ]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21 C"},
    ]  # fmt: skip
    chat_tools = [{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}]
    expected = chat_text(as_chat, 12, tools=chat_tools)
    assert final.output_text == (expected.message.content or "")

    with pytest.raises(openai.BadRequestError, match="not stored"):
        client.responses.create(input="x", previous_response_id=plain.id, **greedy)


def test_pdserve_up_traces_every_process_to_the_collector(deployment, receiver):
    """`pdserve up --otlp-traces-endpoint URL`: a request's trace reaches a real OTLP collector from
    the router and both servers, one trace (tests/test_timings.py checks its spans' shape)."""
    import time

    model, _, client = deployment
    collector, _ = receiver
    client.completions.create(model=model, prompt="trace me", max_tokens=3, temperature=0)
    deadline, ours = time.monotonic() + 30, {"pdserve-router", "pdserve-prefill", "pdserve-decode"}
    while time.monotonic() < deadline:
        roots = [s for service, s in collector.spans if service == "pdserve-router" and s.name == "pdserve.request"]
        traces = {s.trace_id for s in roots}
        services = {service for service, s in collector.spans if s.trace_id in traces}
        if services == ours:
            break
        time.sleep(0.2)
    assert services == ours, services  # (every span of the requests' traces: one trace here, n = 1)
