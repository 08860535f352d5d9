"""The JSON of each server-sent event of a streamed answer (OpenAI's `chat.completion.chunk` and
streamed `text_completion` objects), for one request: its id, model and creation time are in
every chunk.

With tools (and tool_choice not "none") a chat choice's text goes through its own ToolCallStream
(common/openai/tool_parser.py): content streams as it comes, except what could still be a call; a
call is sent whole, in one delta, once its "</tool_call>" has arrived."""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import Executor

from pdserve.common.openai.api import ParsedRequest
from pdserve.common.openai.format import chat_logprobs, completion_logprobs, token_text_of, usage
from pdserve.common.openai.tool_parser import ToolCallStream, finish_reason, forces_calls, tool_names
from pdserve.router.large_answers import OFF_LOOP_ENTRIES, json_in_pieces

_INDEX_MARK = 918273645  # placeholders in StreamChunks' text template
_TEXT_MARK = "\x00text\x00"


class StreamChunks:
    def __init__(self, parsed: ParsedRequest, tokenizer, request_id: str, created: int):
        self.parsed = parsed
        self.chat = parsed.kind == "chat"
        prefix, self.kind = ("chatcmpl-", "chat.completion.chunk") if self.chat else ("cmpl-", "text_completion")
        self.head = {"id": prefix + request_id, "object": self.kind, "created": created, "model": parsed.model}
        self.token_text = token_text_of(tokenizer)
        self.tools = tool_names(parsed) if self.chat else None
        self.tool_streams: dict[int, ToolCallStream] = {}  # choice index -> its parser, from its first text
        self._text_parts = self._text_template()

    def _text_template(self) -> tuple[str, str, str]:
        """A text-only chunk's JSON around its two variables (the choice index, the text): the
        streaming hot path, once per token, then formats two values instead of encoding a dict."""
        text = {"delta": {"content": _TEXT_MARK}} if self.chat else {"text": _TEXT_MARK}
        body = {"index": _INDEX_MARK} | text | {"logprobs": None, "finish_reason": None}  # choice()'s order
        encoded = json.dumps(self.head | {"choices": [body]})
        # rpartition: the marks come after the head, whose model name the client chose.
        before_text, _, after_text = encoded.rpartition(json.dumps(_TEXT_MARK))
        before_index, _, between = before_text.rpartition(str(_INDEX_MARK))
        return before_index, between, after_text

    def choice(
        self, index: int, text: str | None, finish: str | None, role: bool = False, logprobs=None, timings=None
    ) -> str:
        """A choice's delta: its role (chat's first chunk), new text with its tokens' logprobs, or its finish
        (with its `timings`, given when the request asked for them: "return_timings")."""
        if text and finish is None and not role and not (logprobs and self.parsed.logprobs is not None):
            before_index, between, after_text = self._text_parts
            return f"{before_index}{index}{between}{json.dumps(text)}{after_text}"
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            return self._chat_chunk(index, delta, logprobs, finish, timings)
        parsed, lp = self.parsed, None
        if logprobs and parsed.logprobs is not None:
            lp = completion_logprobs(logprobs, parsed.logprobs, self.token_text)
        body = {"index": index, "text": text or "", "logprobs": lp, "finish_reason": finish}
        body |= {"timings": timings} if timings is not None else {}
        return json.dumps(self.head | {"choices": [body]})

    def text(self, index: int, text: str, logprobs=None) -> list[str]:
        """A choice's new text: its chunk, or with tool calls parsed, as many chunks as it finished
        (none while it is held back; its logprobs then come in a chunk of their own, with no text)."""
        if self.tools is None:
            return [self.choice(index, text, None, logprobs=logprobs)]
        stream = self.tool_streams.setdefault(index, ToolCallStream(self.tools, forces_calls(self.parsed)))
        chunks = self._tool_chunks(index, stream, stream.feed(text), logprobs)
        if not chunks and logprobs and self.parsed.logprobs is not None:
            chunks = [self._chat_chunk(index, {}, logprobs, None)]
        return chunks

    def finish(self, index: int, finish: str, timings: dict | None = None) -> list[str]:
        """A choice's last chunks: what its tool-call parser still held, then its finish_reason
        ("tool_calls" for an answer with calls that ended by itself), with its timings when asked for."""
        stream = self.tool_streams.pop(index, None) if self.tools is not None else None
        if stream is None:
            return [self.choice(index, None, finish, timings=timings)]
        chunks = self._tool_chunks(index, stream, stream.finish(), None)
        return chunks + [self.choice(index, None, finish_reason(finish, called=stream.called > 0), timings=timings)]

    def _tool_chunks(self, index: int, stream: ToolCallStream, items: list, logprobs) -> list[str]:
        """One chunk per content piece or call (numbered in the choice's calls); the logprobs ride the first."""
        chunks = []
        first_call = stream.called - sum(isinstance(item, dict) for item in items)
        for item in items:
            if isinstance(item, str):
                delta = {"content": item}
            else:
                delta = {"tool_calls": [{"index": first_call} | item]}
                first_call += 1
            chunks.append(self._chat_chunk(index, delta, logprobs, None))
            logprobs = None
        return chunks

    def _chat_chunk(self, index: int, delta: dict, logprobs, finish: str | None, timings=None) -> str:
        lp = None
        if logprobs and self.parsed.logprobs is not None:
            lp = chat_logprobs(logprobs, self.parsed.logprobs, self.token_text)
        body = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
        body |= {"timings": timings} if timings is not None else {}
        return json.dumps(self.head | {"choices": [body]})

    async def echo(self, index: int, ids: list[int], prompt_logprobs, off_loop: Executor) -> str:
        """Echo: the prompt's text leading a completion's stream, with its tokens' logprobs when asked;
        written on `off_loop` (the router's thread for heavy work) when they are many (router/large_answers.py)."""
        if self.parsed.logprobs is None or len(ids) * (2 + self.parsed.logprobs) < OFF_LOOP_ENTRIES:
            return self._echo(index, ids, prompt_logprobs, False)
        return await asyncio.get_running_loop().run_in_executor(off_loop, self._echo, index, ids, prompt_logprobs, True)

    def _echo(self, index: int, ids: list[int], prompt_logprobs, in_pieces: bool) -> str:
        parsed, lp = self.parsed, None
        if parsed.logprobs is not None:
            lp = completion_logprobs([], parsed.logprobs, self.token_text, (ids, prompt_logprobs or [None]))
        body = {"index": index, "text": parsed.prompt_texts[index // parsed.n], "logprobs": lp, "finish_reason": None}
        chunk = self.head | {"choices": [body]}
        return "".join(json_in_pieces(chunk)) if in_pieces else json.dumps(chunk)

    def usage(self, completions) -> str:
        return json.dumps(self.head | {"choices": [], "usage": usage(self.parsed, completions)})
