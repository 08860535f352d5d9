"""The OpenAI Batch driver end to end, with a fake engine and a tiny real tokenizer."""

import json

import pytest

from pdserve.common.openai.run_batch import run_batch
from tests.test_openai_api import build_tokenizer, fake_completions

MODEL = "tiny"


class FakeEngine:
    """Deterministic: output ids are a function of the prompt and seed; records every generate call."""

    def __init__(self, tokenizer, max_context_len: int = 128):
        self.tokenizer = tokenizer
        self.max_context_len = max_context_len
        self.calls = []

    def generate(self, prompts, params):
        self.calls.append((list(prompts), list(params)))
        return fake_completions(self.tokenizer, prompts, params)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def line(custom_id, url, body, method="POST"):
    return json.dumps({"custom_id": custom_id, "method": method, "url": url, "body": body})


def run(tmp_path, engine, input_lines):
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("\n".join(input_lines) + "\n")
    counts = run_batch(engine, str(source), str(target), MODEL)
    return counts, [json.loads(text) for text in target.read_text().splitlines()]


def test_good_and_bad_lines(tmp_path, tokenizer):
    engine = FakeEngine(tokenizer)
    chat = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 3, "n": 2, "seed": 9, "logprobs": True}
    inputs = [
        line("c1", "/v1/completions", {"model": MODEL, "prompt": ["hello", "world"], "max_tokens": 4}),
        "{not json",
        line("chat1", "/v1/chat/completions", chat),
        "",  # blank lines are skipped
        line("bad-url", "/v1/embeddings", {"input": "x"}),
        line("bad-body", "/v1/completions", {"prompt": "hi", "temperature": "hot"}),
        line("c1", "/v1/completions", {"prompt": "dup"}),
        line("bad-model", "/v1/chat/completions", {"model": "gpt-4", "messages": chat["messages"]}),
        line("get", "/v1/completions", {"prompt": "hi"}, method="GET"),
        json.dumps({"method": "POST", "url": "/v1/completions", "body": {"prompt": "hi"}}),
        line("c2", "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 2, "return_token_ids": True}),
        line("not-an-object", "/v1/completions", ["hi"]),
    ]
    counts, out = run(tmp_path, engine, inputs)

    assert counts == {"total": 11, "succeeded": 3, "failed": 8}
    assert len(out) == 11
    assert [o["custom_id"] for o in out] == [
        "c1", None, "chat1", "bad-url", "bad-body", "c1", "bad-model", "get", None, "c2", "not-an-object"
    ]  # fmt: skip

    # the engine ran once, with every choice of every good line, in line order
    assert len(engine.calls) == 1
    prompts, params = engine.calls[0]
    hello, world = tokenizer("hello")["input_ids"], tokenizer("world")["input_ids"]
    assert len(prompts) == 2 + 2 + 1
    assert prompts[:2] == [hello, world] and prompts[4] == [5, 6, 7]
    assert [p.max_new_tokens for p in params] == [4, 4, 3, 3, 2]

    for o in out:
        assert o["id"].startswith("batch_req_") and o["error"] is None
        assert isinstance(o["response"]["request_id"], str) and len(o["response"]["request_id"]) == 32
    assert len({o["id"] for o in out}) == len(out)  # random, distinct

    completion = out[0]["response"]
    assert completion["status_code"] == 200
    assert completion["body"]["object"] == "text_completion" and completion["body"]["model"] == MODEL
    assert completion["body"]["id"] == "cmpl-" + completion["request_id"]
    texts = [c["text"] for c in completion["body"]["choices"]]
    expected = fake_completions(tokenizer, prompts[:2], params[:2])
    assert texts == [c.text for c in expected]
    assert completion["body"]["usage"]["prompt_tokens"] == len(hello) + len(world)
    assert completion["body"]["usage"]["completion_tokens"] == sum(len(c.output_ids) for c in expected)

    chat_body = out[2]["response"]["body"]
    assert out[2]["response"]["status_code"] == 200 and chat_body["object"] == "chat.completion"
    assert [c["index"] for c in chat_body["choices"]] == [0, 1]
    assert all(len(c["logprobs"]["content"]) == 3 for c in chat_body["choices"])
    assert chat_body["usage"]["completion_tokens"] == 6

    tokens = out[9]["response"]["body"]["choices"][0]
    assert tokens["prompt_token_ids"] == [5, 6, 7] and len(tokens["token_ids"]) == 2

    def error(index):
        response = out[index]["response"]
        assert set(response["body"]) == {"error"}
        assert set(response["body"]["error"]) == {"message", "type", "param", "code"}
        return response["status_code"], response["body"]["error"]["message"]

    assert error(1)[0] == 400 and "line 2 is not valid JSON" in error(1)[1]
    assert error(3)[0] == 400 and "'url' must be one of /v1/completions, /v1/chat/completions" in error(3)[1]
    assert error(4) == (400, "'temperature' must be a number, got string")
    assert error(5)[0] == 400 and "duplicate custom_id 'c1'" in error(5)[1]
    assert error(6) == (404, "The model `gpt-4` does not exist.")
    assert out[6]["response"]["body"]["error"]["code"] == "model_not_found"
    assert error(7)[0] == 400 and "'method' must be \"POST\"" in error(7)[1]
    assert error(8)[0] == 400 and "'custom_id' is required" in error(8)[1]
    assert error(10)[0] == 400 and "must be a JSON object" in error(10)[1]


def test_malformed_envelopes(tmp_path, tokenizer):
    inputs = [
        json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {}, "extra": 1}),
        json.dumps({"custom_id": "b", "method": "POST", "url": "/v1/completions"}),
        "[1, 2]",
        json.dumps({"custom_id": "c", "method": "POST", "url": ["/v1/completions"], "body": {}}),
    ]
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_bytes(("\n".join(inputs) + "\n").encode() + b'{"custom_id": "\xff"}\n')
    counts = run_batch(FakeEngine(tokenizer), str(source), str(target), MODEL)
    assert counts == {"total": 5, "succeeded": 0, "failed": 5}
    out = [json.loads(text) for text in target.read_text().splitlines()]
    messages = [o["response"]["body"]["error"]["message"] for o in out]
    assert "unknown field(s) in the batch line: extra" in messages[0]
    assert "'body' is required" in messages[1]
    assert "line 3 must be a JSON object" in messages[2]
    assert "'url' must be one of" in messages[3]
    assert "line 5 is not valid JSON" in messages[4]


def test_all_bad_lines_never_call_the_engine(tmp_path, tokenizer):
    engine = FakeEngine(tokenizer)
    counts, out = run(tmp_path, engine, [line("x", "/v1/completions", {"prompt": ""})])
    assert counts == {"total": 1, "succeeded": 0, "failed": 1} and engine.calls == []
    assert out[0]["response"]["status_code"] == 400


def test_context_length_comes_from_the_engine(tmp_path, tokenizer):
    engine = FakeEngine(tokenizer, max_context_len=8)
    counts, out = run(tmp_path, engine, [line("x", "/v1/completions", {"prompt": [1] * 6, "max_tokens": 3})])
    assert counts["failed"] == 1
    assert "maximum context length is 8 tokens" in out[0]["response"]["body"]["error"]["message"]


def test_seeded_batches_are_reproducible(tmp_path, tokenizer):
    inputs = [line("s", "/v1/completions", {"prompt": "hello", "n": 3, "seed": 11, "max_tokens": 5})]
    texts = []
    for _ in range(2):
        _, out = run(tmp_path, FakeEngine(tokenizer), inputs)
        texts.append([c["text"] for c in out[0]["response"]["body"]["choices"]])
    assert texts[0] == texts[1] and len(set(texts[0])) == 3
