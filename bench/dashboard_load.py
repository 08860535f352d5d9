"""The mixed load bench/dashboard_render.py drives its stack with, through the official openai client,
so that every row of the dashboard has something to show: streamed chats (ITL, TPOT), completions
that share a long prefix (the prefill server's prefix cache), multi-turn conversations (prefix-aware
transfers: the decode server holds the earlier turns), long prompts, structured outputs, and an
over-long request the router refuses (a 400 beside the 200s).
"""

from __future__ import annotations

import collections
import threading
import time

# The tiny model's tokenizer is byte-level BPE over 512 tokens and its context 1024 tokens
# (common/tiny_model.py): a character is a bit under a token, so prompts stay under ~700 characters.
SHARED_PREFIX = (
    "You are a careful assistant for a serving benchmark. Answer briefly, in plain words, and never repeat "
    "the question. The rules below hold for every answer: be exact with numbers, say when you do not know, "
    "prefer short sentences, and keep lists to three items. "
)
LONG_TEXT = "Prefill processes the whole prompt at once; decode adds one token per step. " * 8
POINT_SCHEMA = {
    "type": "object",
    "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
    "required": ["x", "y"],
}
# One client's cycle of request kinds; the clients start at different places in it.
CYCLE = ("stream", "shared_prefix", "chat_turn", "shared_prefix", "stream", "long", "chat_turn", "structured")
TOO_LONG_EVERY = 25  # every 25th request of a client asks for more tokens than the context holds (a 400)


def drive_load(base_url: str, seconds: float, clients: int) -> str:
    """Run `clients` threads of requests for `seconds`; a one-line summary (requests by outcome)."""
    import openai

    model = openai.OpenAI(base_url=base_url + "/v1", api_key="unused").models.list().data[0].id
    outcomes: collections.Counter[str] = collections.Counter()
    lock = threading.Lock()
    deadline = time.monotonic() + seconds

    def client_loop(index: int) -> None:
        client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
        conversation: list[dict] = []
        sent = 0
        while time.monotonic() < deadline:
            kind = "too_long" if sent % TOO_LONG_EVERY == TOO_LONG_EVERY - 1 else CYCLE[(index + sent) % len(CYCLE)]
            try:
                one_request(client, model, kind, f"{index}-{sent}", conversation)
                outcome = kind
            except openai.APIStatusError as e:
                outcome = f"{kind} {e.status_code}"
            except openai.APIConnectionError:
                outcome = f"{kind} connection error"
            with lock:
                outcomes[outcome] += 1
            sent += 1

    threads = [threading.Thread(target=client_loop, args=(i,), name=f"client-{i}") for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return ", ".join(f"{count} {outcome}" for outcome, count in sorted(outcomes.items()))


def one_request(client, model: str, kind: str, tag: str, conversation: list[dict]) -> None:
    """One request of `kind`; `conversation` is the client's multi-turn chat, grown (and restarted
    after four turns: the context is short) by the chat turns."""
    if kind == "stream":
        stream = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": f"Tell a short story about request {tag}."}],
            max_tokens=48,
            stream=True,
        )
        for _ in stream:
            pass
    elif kind == "shared_prefix":
        client.completions.create(model=model, prompt=SHARED_PREFIX + f"Question {tag}: what is 2+2?", max_tokens=16)
    elif kind == "chat_turn":
        if len(conversation) >= 8:
            conversation.clear()
        conversation.append({"role": "user", "content": f"Turn {len(conversation) // 2} of {tag}: go on."})
        answer = client.chat.completions.create(model=model, messages=conversation, max_tokens=24)
        conversation.append({"role": "assistant", "content": answer.choices[0].message.content or ""})
    elif kind == "long":
        client.completions.create(model=model, prompt=LONG_TEXT + tag, max_tokens=64)
    elif kind == "structured":
        client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": f"A point for {tag} as JSON."}],
            max_tokens=48,
            response_format={"type": "json_schema", "json_schema": {"name": "point", "schema": POINT_SCHEMA}},
        )
    elif kind == "too_long":
        client.completions.create(model=model, prompt="Too long: " + tag, max_tokens=4096)
    else:
        raise ValueError(f"unknown request kind {kind!r}")
