"""OpenAI tool calling, response side: Hermes-style <tool_call> blocks read out of a choice's text,
whole (format.py) or as it streams (router/stream_chunks.py).

Both read through ToolCallStream, so a streamed choice's content deltas and calls add up to exactly
the non-streamed message whatever the chunk boundaries. What becomes of the text:
- a block `<tool_call>{"name": N, "arguments": {...}}</tool_call>` (whitespace around the JSON
  allowed) with N one of the request's tools: a call; arguments may also come as a JSON string
  holding an object (some models encode them twice);
- any other block (JSON that does not parse, an unknown name, other keys), and a block the answer
  never closes: content, verbatim;
- everything else: content, except whitespace at its start and end and just before a call (the
  separators between calls): that is dropped, as a strip() would.
"""

from __future__ import annotations

import json
import secrets

from pdserve.common.openai.api import ParsedRequest
from pdserve.common.openai.tools import CALL_BEGIN, CALL_END


def tool_names(parsed: ParsedRequest) -> frozenset[str] | None:
    """The tools whose calls are parsed out of `parsed`'s answers; None: none are (no tools, or
    tool_choice "none": the text is the content, as it came)."""
    if not parsed.tools or parsed.tool_choice == "none":
        return None
    return frozenset(tool["function"]["name"] for tool in parsed.tools)


def forces_calls(parsed: ParsedRequest) -> bool:
    """Whether tool_choice forces calls ("required" or a named function): the grammar then admits
    nothing but calls, and what is not a whole call (one cut short by max_tokens) is dropped, never
    sent as content."""
    return parsed.tool_choice not in ("none", "auto")


def finish_reason(finish: str, called: bool) -> str:
    """OpenAI's finish_reason: "tool_calls" for an answer that ended (not cut short) with calls."""
    return "tool_calls" if called and finish == "stop" else finish


def _partial_begin(text: str) -> int:
    """How many characters at the end of `text` could start a CALL_BEGIN the next delta finishes."""
    for size in range(min(len(CALL_BEGIN) - 1, len(text)), 0, -1):
        if text.endswith(CALL_BEGIN[:size]):
            return size
    return 0


class ToolCallStream:
    """One choice's text in, content pieces (str) and calls (OpenAI's message.tool_calls entries)
    out, in the order they appear.

    NOTE: text is held back while it could still change meaning: a trailing partial "<tool_call>"
    (it must never leak into content), a block until its "</tool_call>", and trailing whitespace
    (dropped if a call or the end follows). finish() releases what is held."""

    def __init__(self, names: frozenset[str], forced: bool = False):
        self.names = names
        self.forced = forced  # forces_calls(): no content at all
        self.pending = ""  # outside a block: text not yet judged (a partial CALL_BEGIN at most)
        self.block: str | None = None  # inside a block: its text since CALL_BEGIN
        self.space = ""  # whitespace held after the content sent
        self.space_before_block = ""  # the whitespace a block dropped: restored if it is content after all
        self.started = False  # whether any content was sent (leading whitespace is dropped)
        self.called = 0  # calls sent

    def feed(self, text: str) -> list[str | dict]:
        out: list[str | dict] = []
        if self.block is None:
            self.pending += text
        else:
            self.block += text
        while True:
            if self.block is not None:
                end = self.block.find(CALL_END)
                if end < 0:
                    return out
                inner, self.pending, self.block = self.block[:end], self.block[end + len(CALL_END) :], None
                call = self._call(inner)
                if call is None:
                    self.space = self.space_before_block
                    self._content(CALL_BEGIN + inner + CALL_END, out)
                else:
                    self.called += 1
                    out.append(call)
                continue
            begin = self.pending.find(CALL_BEGIN)
            if begin < 0:
                keep = len(self.pending) - _partial_begin(self.pending)
                self._content(self.pending[:keep], out)
                self.pending = self.pending[keep:]
                return out
            self._content(self.pending[:begin], out)
            self.space_before_block, self.space = self.space, ""
            self.block, self.pending = self.pending[begin + len(CALL_BEGIN) :], ""

    def finish(self) -> list[str | dict]:
        """What is still held, as content: an unclosed block or a partial tag. Trailing whitespace is dropped."""
        out: list[str | dict] = []
        if self.block is not None:
            self.space = self.space_before_block
            self._content(CALL_BEGIN + self.block, out)
            self.block = None
        self._content(self.pending, out)
        self.pending = self.space = ""
        return out

    def _content(self, text: str, out: list[str | dict]) -> None:
        if self.forced:
            return
        text = self.space + text
        body = text.rstrip()
        self.space = text[len(body) :]
        if not body:
            return
        if not self.started:
            body, self.started = body.lstrip(), True
        if out and isinstance(out[-1], str):
            out[-1] += body
        else:
            out.append(body)

    def _call(self, inner: str) -> dict | None:
        """The call a block's text holds, or None when it is not a call of one of the tools."""
        try:
            call = json.loads(inner)
            if not isinstance(call, dict) or set(call) != {"name", "arguments"} or call["name"] not in self.names:
                return None
            arguments = call["arguments"]
            if isinstance(arguments, str):
                arguments = json.loads(arguments)
            if not isinstance(arguments, dict):
                return None
            # No NaN (not JSON); no lone surrogate (from a "\ud800" escape: the answer could not be encoded).
            arguments = json.dumps(arguments, ensure_ascii=False, allow_nan=False)
            arguments.encode("utf-8")
        except (ValueError, TypeError, RecursionError):  # TypeError: a name that is a list or a dict
            return None
        return {
            "id": f"call_{secrets.token_hex(12)}",
            "type": "function",
            "function": {"name": call["name"], "arguments": arguments},
        }


def parse_tool_calls(text: str, names: frozenset[str], forced: bool = False) -> tuple[str | None, list[dict]]:
    """A whole answer's (content or None when there is none, calls); `forced` as ToolCallStream's."""
    stream = ToolCallStream(names, forced)
    items = stream.feed(text) + stream.finish()
    content = "".join(item for item in items if isinstance(item, str))
    return content or None, [item for item in items if isinstance(item, dict)]
