"""The JSON of each server-sent event of a streamed answer (OpenAI's `chat.completion.chunk` and
streamed `text_completion` objects), for one request: its id, model and creation time are in
every chunk."""

from __future__ import annotations

import json

from pdserve.common.openai.api import ParsedRequest
from pdserve.common.openai.format import chat_logprobs, completion_logprobs, token_text_of, usage


class StreamChunks:
    def __init__(self, parsed: ParsedRequest, tokenizer, request_id: str, created: int):
        self.parsed = parsed
        self.chat = parsed.kind == "chat"
        prefix, self.kind = ("chatcmpl-", "chat.completion.chunk") if self.chat else ("cmpl-", "text_completion")
        self.head = {"id": prefix + request_id, "object": self.kind, "created": created, "model": parsed.model}
        self.token_text = token_text_of(tokenizer)

    def choice(self, index: int, text: str | None, finish: str | None, role: bool = False, logprobs=None) -> str:
        """A choice's delta: its role (chat's first chunk), new text with its tokens' logprobs, or its finish."""
        parsed, lp = self.parsed, None
        if logprobs and parsed.logprobs is not None:
            lp = (chat_logprobs if self.chat else completion_logprobs)(logprobs, parsed.logprobs, self.token_text)
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            body = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
        else:
            body = {"index": index, "text": text or "", "logprobs": lp, "finish_reason": finish}
        return json.dumps(self.head | {"choices": [body]})

    def echo(self, index: int, ids: list[int], prompt_logprobs) -> str:
        """Echo: the prompt's text leading a completion's stream, with its tokens' logprobs when asked."""
        parsed, lp = self.parsed, None
        if parsed.logprobs is not None:
            lp = completion_logprobs([], parsed.logprobs, self.token_text, (ids, prompt_logprobs or [None]))
        body = {"index": index, "text": parsed.prompt_texts[index // parsed.n], "logprobs": lp, "finish_reason": None}
        return json.dumps(self.head | {"choices": [body]})

    def usage(self, completions) -> str:
        return json.dumps(self.head | {"choices": [], "usage": usage(self.parsed, completions)})
