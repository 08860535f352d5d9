"""The Responses API's stream (common/openai/responses.py): a streamed chat answer's chunks, as the
chat endpoint sends them (router/stream_chunks.py), turned into the Responses events, each an SSE
`event:` line and its `data:`, numbered by `sequence_number`:

    response.created, response.in_progress
    response.output_item.added (a message), response.content_part.added,
        response.output_text.delta ..., response.output_text.done, response.content_part.done,
        response.output_item.done
    per tool call (the chat stream sends each call whole): response.output_item.added (a
        function_call), response.function_call_arguments.delta, ...arguments.done, response.output_item.done
    response.completed (or response.incomplete at max_output_tokens, with the usage)
    on a failure mid-stream: error, then response.failed — never a normal-looking end
"""

from __future__ import annotations

import json

from pdserve.common.openai.responses import call_item, finish, message_item, new_id


class ResponseEvents:
    def __init__(self, response: dict):
        self.response = response
        self.sequence = 0
        self.text_id: str | None = None  # the open message item's, while text streams
        self.text_index = 0
        self.text = ""
        self.finish_reason: str | None = None
        self.usage: dict | None = None

    def event(self, kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def start(self) -> list[str]:
        return [
            self.event("response.created", response=self.response),
            self.event("response.in_progress", response=self.response),
        ]

    def chunk(self, chunk: dict) -> list[str]:
        """The events of one chat chunk (a failure's error object included)."""
        if "error" in chunk:
            return self.fail(chunk["error"])
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        events = []
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("content"):
                events += self._text(delta["content"])
            for call in delta.get("tool_calls") or ():
                events += self._close_text() + self._call(call)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return events

    def _text(self, delta: str) -> list[str]:
        events = []
        if self.text_id is None:
            item = message_item("", status="in_progress")
            self.text_id, self.text_index, self.text = item["id"], len(self.response["output"]), ""
            self.response["output"].append(item)
            part = {"type": "output_text", "text": "", "annotations": []}
            events += [
                self.event("response.output_item.added", output_index=self.text_index, item=item),
                self.event(
                    "response.content_part.added",
                    item_id=self.text_id,
                    output_index=self.text_index,
                    content_index=0,
                    part=part,
                ),
            ]
        self.text += delta
        where = {"item_id": self.text_id, "output_index": self.text_index, "content_index": 0}
        return events + [self.event("response.output_text.delta", delta=delta, logprobs=[], **where)]

    def _close_text(self) -> list[str]:
        if self.text_id is None:
            return []
        item = message_item(self.text, item_id=self.text_id)
        self.response["output"][self.text_index] = item
        where = {"item_id": self.text_id, "output_index": self.text_index, "content_index": 0}
        self.text_id = None
        return [
            self.event("response.output_text.done", text=self.text, logprobs=[], **where),
            self.event("response.content_part.done", part=item["content"][0], **where),
            self.event("response.output_item.done", output_index=where["output_index"], item=item),
        ]

    def _call(self, call: dict) -> list[str]:
        index = len(self.response["output"])
        item = call_item(call, status="in_progress", item_id=new_id("fc"))
        self.response["output"].append(call_item(call, item_id=item["id"]))
        arguments = call["function"]["arguments"]
        where = {"item_id": item["id"], "output_index": index}
        return [
            self.event("response.output_item.added", output_index=index, item=item),
            self.event("response.function_call_arguments.delta", delta=arguments, **where),
            self.event("response.function_call_arguments.done", arguments=arguments, **where),
            self.event("response.output_item.done", output_index=index, item=self.response["output"][index]),
        ]

    def end(self) -> list[str]:
        """After the chat stream's last chunk: the open text closed, the response completed."""
        events = self._close_text()
        finish(self.response, self.finish_reason, self.usage)
        kind = "response.incomplete" if self.response["status"] == "incomplete" else "response.completed"
        return events + [self.event(kind, response=self.response)]

    def fail(self, error: dict) -> list[str]:
        self.response["status"] = "failed"
        self.response["error"] = {"code": error.get("code") or "server_error", "message": error.get("message", "")}
        return [
            self.event("error", code=error.get("code"), message=error.get("message", ""), param=error.get("param")),
            self.event("response.failed", response=self.response),
        ]
