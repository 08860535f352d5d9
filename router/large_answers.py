"""Answers that are much work to write, written off the event loop.

An answer with many tokens' entries (an echo of a long prompt with its logprobs, vLLM's prompt
logprobs, long outputs with logprobs, every choice's own) costs ~2 us an entry to build and encode:
an echo of 8k tokens with prompt logprobs held a router process's loop ~450 ms (SmolLM2's tokenizer,
2-core host), and with it every other request, stream and health check of the process. Past
OFF_LOOP_ENTRIES it is built on the router's thread for heavy work (router/app.py), and its JSON
encoded in pieces: json.dumps holds the GIL from start to end, so one call on the whole answer would
hold the loop as long on a thread as on the loop. So built, that answer held the loop ~15 ms at worst.
"""

from __future__ import annotations

import asyncio
import functools
import json

from fastapi.responses import JSONResponse, Response

from pdserve.common.openai.api import ParsedRequest
from pdserve.common.openai.format import format_response
from pdserve.common.types import Completion

OFF_LOOP_ENTRIES = 2048  # ~4 ms of work
PIECE = 128  # list items one json.dumps call encodes: ~3 ms for 128 tokens' 21 entries each


def answer_entries(parsed: ParsedRequest, completions: list[Completion]) -> int:
    """How many entries an answer holds: each token it reports (its text, its id) counts one, and one
    more for each logprob reported with it."""
    output = 1 + (0 if parsed.logprobs is None else 1 + parsed.logprobs) + parsed.return_token_ids
    prompt = parsed.return_token_ids + (0 if parsed.prompt_logprobs is None else 1 + parsed.prompt_logprobs)
    if parsed.echo and parsed.logprobs is not None:
        prompt += 1 + parsed.logprobs
    return sum(len(c.output_ids) * output + len(c.prompt_ids) * prompt for c in completions)


async def whole_answer(router, parsed: ParsedRequest, completions: list[Completion], request_id: str, created: int):
    """The JSON answer of a request not streamed (common/openai/format.py); on the router's thread for
    heavy work (router/app.py) when it is large."""
    if answer_entries(parsed, completions) < OFF_LOOP_ENTRIES:
        return JSONResponse(format_response(parsed, completions, router.tokenizer, request_id, created))
    loop = asyncio.get_running_loop()
    body = await loop.run_in_executor(
        router.off_loop, encoded_answer, parsed, completions, router.tokenizer, request_id, created
    )
    return Response(body, media_type="application/json")


def encoded_answer(parsed: ParsedRequest, completions: list[Completion], tokenizer, request_id: str, created: int):
    answer = format_response(parsed, completions, tokenizer, request_id, created)
    pieces = json_in_pieces(answer, ensure_ascii=False, allow_nan=False, separators=(",", ":"))  # JSONResponse's
    return b"".join(piece.encode() for piece in pieces)


def json_in_pieces(value, **options) -> list[str]:
    """The text of json.dumps(value, **options), in pieces, each from a call that encodes at most PIECE
    items of a list: a long list is encoded in slices, dicts and short lists an item at a time.

    Consumes `value`: each list and dict is emptied once encoded, so that the answer is freed a piece
    at a time too (freed at once, the 1.5M objects of an 8k-token echo held the GIL ~30 ms). And no
    piece is joined to another here: a copy of a 40 MB string (4 bytes a character, once one is
    past U+FFFF) holds the GIL as long as a call that encodes it.

    NOTE: an item of a long list is encoded in one call, whatever it holds: fine for an answer's long
    lists, whose items are one token's entries (or ids), not for any JSON."""
    item_separator, key_separator = options.get("separators") or (", ", ": ")
    dumps = functools.partial(json.dumps, **options)
    pieces: list[str] = []

    def encode(v) -> None:
        if isinstance(v, dict) and all(isinstance(k, str) for k in v):
            pieces.append("{")
            for i, (k, x) in enumerate(v.items()):
                pieces.append((item_separator if i else "") + dumps(k) + key_separator)
                encode(x)
            pieces.append("}")
            v.clear()
        elif isinstance(v, list) and len(v) > PIECE:
            pieces.append("[" + dumps(v[:PIECE])[1:-1])
            del v[:PIECE]
            while v:
                pieces.append(item_separator + dumps(v[:PIECE])[1:-1])
                del v[:PIECE]
            pieces.append("]")
        elif isinstance(v, list):
            pieces.append("[")
            for i, x in enumerate(v):
                if i:
                    pieces.append(item_separator)
                encode(x)
            pieces.append("]")
            v.clear()
        else:
            pieces.append(dumps(v))

    encode(value)
    return pieces
