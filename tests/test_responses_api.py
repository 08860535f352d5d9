"""The Responses API's translation (common/openai/responses.py, response_events.py) on its own:
what a Responses body becomes as a chat body, what is refused, and the stream's events in order — a
failure mid-stream ends with `error` and `response.failed`, never `response.completed`. Through a
real stack with the official client: tests/test_router.py."""

import asyncio
import json

import pytest

from pdserve.common.openai.fields import OpenAIError
from pdserve.common.openai.response_events import ResponseEvents
from pdserve.common.openai.responses import chat_body, response_object
from pdserve.router.responses_routes import events

TOOL = {"type": "function", "name": "weather", "parameters": {"type": "object", "properties": {}}}


def test_a_conversation_becomes_the_chat_request_that_serves_it():
    body = {
        "model": "m",
        "instructions": "Be brief.",
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
            {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": "{}"},
            {"type": "function_call", "call_id": "c2", "name": "weather", "arguments": '{"a": 1}'},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            {"type": "function_call_output", "call_id": "c2", "output": {"t": 20}},
        ],
        "max_output_tokens": 9,
        "tools": [TOOL],
        "tool_choice": {"type": "function", "name": "weather"},
        "text": {"format": {"type": "json_schema", "name": "s", "schema": {"type": "object"}, "strict": True}},
        "stream": True,
        "store": True,
    }
    chat = chat_body(body)
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": "{}"}},
                {"id": "c2", "type": "function", "function": {"name": "weather", "arguments": '{"a": 1}'}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": '{"t": 20}'},
    ]
    assert chat["max_tokens"] == 9 and chat["stream_options"] == {"include_usage": True}
    assert chat["tools"] == [{"type": "function", "function": {"name": "weather", "parameters": TOOL["parameters"]}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "weather"}}
    assert chat["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "s", "schema": {"type": "object"}, "strict": True},
    }
    assert chat_body({"input": "hi"})["messages"] == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "body, words",
    [
        ({"input": "x", "previous_response_id": "resp_1"}, "not stored"),
        ({"input": []}, "non-empty"),
        ({"input": [{"type": "reasoning"}]}, "not served"),
        ({"input": [{"role": "wizard", "content": "x"}]}, "role"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "text"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "function tool"),
        ({"input": "x", "text": {"format": {"type": "xml"}}}, "json_schema"),
        ({"input": "x", "reasoning": {"effort": "high"}}, "unknown"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "call_id"),
    ],
)
def test_what_is_not_served_is_a_400_naming_it(body, words):
    with pytest.raises(OpenAIError, match=words) as refused:
        chat_body(body)
    assert refused.value.status_code == 400


def chunk(content=None, calls=None, finish=None) -> str:
    delta = {k: v for k, v in (("content", content), ("tool_calls", calls)) if v is not None}
    return "data: " + json.dumps({"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}) + "\n\n"


def run(chat_chunks: list[str]) -> list[dict]:
    async def chunks():
        for text in chat_chunks:
            yield text

    async def collect():
        translate = ResponseEvents(response_object({"input": "x"}, "resp_1", 0, "m"))
        return [text async for text in events(chunks(), translate)]

    out = []
    for text in asyncio.run(collect()):
        for block in filter(None, text.split("\n\n")):
            kind, data = block.split("\n")
            out.append(json.loads(data.removeprefix("data: ")) | {"event": kind.removeprefix("event: ")})
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    assert all(e["event"] == e["type"] for e in out)
    return out


def test_a_streamed_answer_with_a_call_gives_the_events_in_order():
    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}
    usage = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    out = run(
        [
            chunk(content="It is "),
            chunk(content="sunny") + chunk(calls=[call]),
            chunk(finish="tool_calls"),
            "data: " + json.dumps({"choices": [], "usage": usage}) + "\n\ndata: [DONE]\n\n",
        ]
    )
    assert [e["type"] for e in out] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    done = out[-1]["response"]
    assert done["status"] == "completed" and done["usage"]["output_tokens"] == 3
    message, called = done["output"]
    assert message["content"][0]["text"] == "It is sunny" and called["call_id"] == "call_1"


def test_a_failure_mid_stream_ends_with_an_error_and_response_failed():
    error = {"error": {"message": "decode server 1.2.3.4:5 stopped answering", "type": "server_error", "code": None}}
    out = run([chunk(content="It is "), "data: " + json.dumps(error) + "\n\n", chunk(content="never sent")])
    assert [e["type"] for e in out][-2:] == ["error", "response.failed"]
    assert "stopped answering" in out[-2]["message"] and out[-1]["response"]["status"] == "failed"
    assert not any(e["type"] in ("response.completed", "response.output_text.done") for e in out)


def test_an_answer_cut_at_max_output_tokens_is_incomplete():
    out = run([chunk(content="abc"), chunk(finish="length")])
    assert out[-1]["type"] == "response.incomplete"
    assert out[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
