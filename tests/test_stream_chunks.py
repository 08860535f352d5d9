"""router/stream_chunks.py: the text-only fast path writes what the general path writes."""

import json
from types import SimpleNamespace

import pytest

from pdserve.router.stream_chunks import StreamChunks


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("text", ["plain", 'hé "quoted" \\ back\nslash', "\x00\u2028 918273645", "🙂"])
def test_the_text_fast_path_equals_the_general_chunk(kind, text):
    # A model name holding the template's own placeholders must not confuse it.
    parsed = SimpleNamespace(kind=kind, model='m "918273645" \x00text\x00', logprobs=None, tools=None, tool_choice=None)
    chunks = StreamChunks(parsed, None, "rid", 1700000000)
    fast = chunks.choice(7, text, None)
    body = ({"index": 7, "delta": {"content": text}} if kind == "chat" else {"index": 7, "text": text}) | {
        "logprobs": None,
        "finish_reason": None,
    }
    general = json.dumps(chunks.head | {"choices": [body]})
    assert fast == general
    assert json.loads(fast)["choices"][0]["index"] == 7
