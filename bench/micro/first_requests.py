"""How long a fresh server's first structured requests take against the next ones (the official client).

    python -m pdserve.bench.micro.first_requests --base-url http://127.0.0.1:8000/v1 [--max-tokens 48]

Against a router that has served nothing yet, in this order: a plain chat, a json_schema response
(schema A), another json_schema (schema B, so nothing compiled for A is reused), a required tool
call (tool set X), another (tool set Y), then plain chats again. Each is greedy with the same
`max_tokens`, so a random-weight model's answers are of equal length whatever they say. Printed:
each request's seconds, and first / second for both kinds (the must-show: ≤ 2).
"""

from __future__ import annotations

import argparse
import json
import time

SCHEMA_A = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
    "required": ["city", "population"],
}
SCHEMA_B = {
    "type": "object",
    "properties": {"title": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["title", "tags"],
}
TOOLS_X = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
TOOLS_Y = [
    {
        "type": "function",
        "function": {
            "name": "search_flights",
            "parameters": {
                "type": "object",
                "properties": {"origin": {"type": "string"}, "seats": {"type": "integer"}},
                "required": ["origin", "seats"],
            },
        },
    }
]


def requests() -> list[tuple[str, dict]]:
    """(label, the chat.completions.create keywords beyond model/messages/max_tokens) in order."""

    def schema(name, s):
        return {"response_format": {"type": "json_schema", "json_schema": {"name": name, "schema": s}}}

    return [
        ("chat", {}),
        ("json_schema A (first)", schema("a", SCHEMA_A)),
        ("json_schema B (second)", schema("b", SCHEMA_B)),
        ("tool call X (first)", {"tools": TOOLS_X, "tool_choice": "required"}),
        ("tool call Y (second)", {"tools": TOOLS_Y, "tool_choice": "required"}),
        ("chat again", {}),
    ]


def main(argv: list[str] | None = None) -> int:
    from openai import OpenAI

    prog = "python -m pdserve.bench.micro.first_requests"
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    parser.add_argument("--base-url", required=True, help="The router's OpenAI base URL (…/v1).")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args(argv)
    client = OpenAI(base_url=args.base_url, api_key="unused", timeout=300)
    model = client.models.list().data[0].id
    times: dict[str, float] = {}
    for label, extra in requests():
        start = time.perf_counter()
        client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Describe a city."}],
            max_tokens=args.max_tokens,
            temperature=0,
            **extra,
        )
        times[label] = time.perf_counter() - start
        print(f"{label:24s} {times[label]:8.3f} s", flush=True)
    ratios = {
        "json_schema first/second": times["json_schema A (first)"] / times["json_schema B (second)"],
        "tool call first/second": times["tool call X (first)"] / times["tool call Y (second)"],
    }
    for name, ratio in ratios.items():
        print(f"{name}: {ratio:.2f}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"seconds": times, "ratios": ratios}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
