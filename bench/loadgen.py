"""The serving benchmark's load generator: arrival times, the requests, and what each one saw.

A backend is anything with `stream(prompt_ids, output_len) -> async iterator of Chunk`: the
OpenAI-compatible HTTP endpoint here, or transformers in-process (hf_serve.py). The timing is the
same for both (metrics.py has the definitions).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import dataclass
from typing import AsyncIterator

from pdserve.bench.http_client import post_events
from pdserve.bench.metrics import RequestResult


@dataclass
class Chunk:
    """One piece of a streamed answer: when it arrived, whether it carries output tokens, and the
    output token count when the server reports it (usage)."""

    stamp: float
    tokens: bool
    usage_tokens: int | None = None
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, with the usage


class OpenAIBackend:
    """/v1/completions with stream=true, ignore_eos, temperature 0 and the usage at the end."""

    def __init__(self, base_url: str, model: str, api_key: str = ""):
        self.base_url, self.model, self.api_key = base_url, model, api_key  # what a client worker rebuilds it from
        self.url = base_url.rstrip("/") + "/v1/completions"
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async def stream(self, prompt: list[int], output_len: int) -> AsyncIterator[Chunk]:
        payload = {
            "model": self.model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
        }  # fmt: skip
        async for stamp, data in post_events(self.url, payload, self.headers):
            if data == "[DONE]":
                return
            message = json.loads(data)
            if "error" in message:  # an error inside a 200 stream
                raise RuntimeError(f"server error: {message['error']}")
            choices = message.get("choices") or []
            usage = message.get("usage") or {}
            details = usage.get("prompt_tokens_details") or {}
            yield Chunk(
                stamp,
                tokens=bool(choices and choices[0].get("text")),
                usage_tokens=usage.get("completion_tokens"),
                cached_tokens=details.get("cached_tokens"),
            )


async def timed_request(backend, prompt: list[int], output_len: int, timeout_s: float) -> RequestResult:
    """Send one request and time its chunks; failures (errors, wrong token counts) are recorded, not raised."""
    result = RequestResult(prompt_len=len(prompt))
    start = time.perf_counter()
    try:
        last = await asyncio.wait_for(_read_answer(backend, prompt, output_len, result, start), timeout_s)
    except Exception as e:  # noqa: BLE001 - any failure of one request is that request's result
        result.error = f"{type(e).__name__}: {e}"
        return result
    if last is None:
        # (random weights can generate only tokens that decode to no text, e.g. a special token
        # repeated: the usage then still counts them)
        result.error = f"no chunk carried text ({result.output_tokens} output tokens reported, {output_len} asked)"
    elif result.output_tokens != output_len:
        # Usage missing, or a server that stopped early although ignore_eos was asked for.
        result.error = f"{result.output_tokens} output tokens reported, expected {output_len}"
    else:
        result.e2e = last - start
        result.success = True
    return result


async def _read_answer(
    backend, prompt: list[int], output_len: int, result: RequestResult, start: float
) -> float | None:
    """Fill result's TTFT, ITL and output tokens; return when the last token-carrying chunk arrived."""
    last = None
    async for chunk in backend.stream(prompt, output_len):
        if chunk.usage_tokens is not None:
            result.output_tokens = chunk.usage_tokens
            result.cached_tokens = chunk.cached_tokens
        if not chunk.tokens:
            continue
        if last is None:
            result.ttft = chunk.stamp - start
        else:
            result.itl.append(chunk.stamp - last)
        last = chunk.stamp
    return last


def arrival_times(num_requests: int, rate: float, seed: int) -> list[float]:
    """Send offsets in seconds: a Poisson process (exponential gaps) at `rate`; inf: all at 0."""
    if math.isinf(rate):
        return [0.0] * num_requests
    rng = random.Random(seed)
    times, t = [], 0.0
    for _ in range(num_requests):
        times.append(t)
        t += rng.expovariate(rate)
    return times


def per_request(output_len: int | list[int], count: int) -> list[int]:
    """Each request's output length: one int for all, or a list parallel to the prompts."""
    if isinstance(output_len, int):
        return [output_len] * count
    if len(output_len) != count:
        raise ValueError(f"{count} prompts but {len(output_len)} output lengths")
    return list(output_len)


async def run_schedule(
    backend,
    prompts: list[list[int]],
    output_len: int | list[int],
    rate: float,
    max_concurrency: int,
    seed: int,
    timeout_s: float,
) -> tuple[list[RequestResult], float]:
    """Send every prompt at its arrival time (waiting for a free slot under max_concurrency > 0);
    returns the results in prompt order and the duration from the start to the last answer.
    output_len: one for every request, or each request's (a list parallel to prompts)."""
    offsets = arrival_times(len(prompts), rate, seed)
    output_lens = per_request(output_len, len(prompts))
    start = time.perf_counter()
    results = await send_on_schedule(backend, prompts, offsets, output_lens, max_concurrency, timeout_s, start)
    return results, time.perf_counter() - start


async def send_on_schedule(
    backend,
    prompts: list[list[int]],
    offsets: list[float],
    output_lens: list[int],
    max_concurrency: int,
    timeout_s: float,
    start: float,
) -> list[RequestResult]:
    """Send prompt i, asking for output_lens[i] tokens, at `start` (a perf_counter time) +
    offsets[i], at most max_concurrency > 0 in flight; the results in prompt order. A send time
    already past goes at once."""
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency > 0 else None

    async def one(prompt: list[int], offset: float, output_len: int) -> RequestResult:
        await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
        if slots is None:
            return await timed_request(backend, prompt, output_len, timeout_s)
        async with slots:  # timing starts once the request is sent, as vllm bench serve does
            return await timed_request(backend, prompt, output_len, timeout_s)

    return list(await asyncio.gather(*(one(p, t, n) for p, t, n in zip(prompts, offsets, output_lens, strict=True))))
