"""Large bodies parsed in the router worker's parser process (router/body_parser.py): the worker's
event loop stays free however large or dense the body (within --max-body-bytes), token-id prompts
come back as the lists json.loads gives, and what no request needs is refused or dropped there."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from pdserve.common.openai.api import OpenAIError
from pdserve.router.body_parser import MAX_VALUES, BodyParser


async def parsed_while_timing_the_loop(parser: BodyParser, raw: bytes, max_ids: int):
    """(the parsed body or the OpenAIError, the event loop's worst lateness in s while it was parsed)."""
    lateness, done = [0.0], False

    async def tick() -> None:
        while not done:
            asked = time.perf_counter()
            await asyncio.sleep(0.002)
            lateness[0] = max(lateness[0], time.perf_counter() - asked - 0.002)

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0.01)
    try:
        result = await parser.loads(raw, max_ids)
    except OpenAIError as e:
        result = e
    done = True
    await ticker
    return result, lateness[0]


@pytest.fixture(scope="module")
def bodies():
    keys = [str(i) for i in range(500_000)]
    return {
        "100 prompts x 8k token ids (4.5 MiB)": json.dumps({"prompt": [list(range(1, 8001))] * 100}).encode(),
        "one prompt of 2M token ids (16 MiB)": json.dumps({"prompt": list(range(1, 2_000_001))}).encode(),
        "500k logit_bias entries (6 MiB)": json.dumps({"prompt": "x", "logit_bias": dict.fromkeys(keys, 1)}).encode(),
        "500k metadata entries (8 MiB)": json.dumps({"prompt": "hi", "metadata": dict.fromkeys(keys, 1)}).encode(),
        "12 MB of text": json.dumps({"prompt": "hello world " * 1_000_000}).encode(),
        "not JSON": b'{"prompt": [1, 2' + b", 3" * 100_000,
    }  # fmt: skip


def test_large_bodies_leave_the_loop_free_and_parse_as_json_loads_would(bodies):
    async def run():
        parser = BodyParser()
        try:
            assert await parser.loads(b'{"a": [1, 2]}', 8192) == {"a": [1, 2]}  # (the process started)
            results = {}
            for name, raw in bodies.items():
                results[name] = await parsed_while_timing_the_loop(parser, raw, 8192)
                print(f"\n{name}: the loop at worst {results[name][1] * 1e3:.1f} ms late")
            return results
        finally:
            parser.close()

    results = asyncio.run(run())
    for name, (_, late) in results.items():
        assert late < 0.05, (name, late)
    body = results["100 prompts x 8k token ids (4.5 MiB)"][0]
    assert body == json.loads(bodies["100 prompts x 8k token ids (4.5 MiB)"])
    too_long = results["one prompt of 2M token ids (16 MiB)"][0]
    assert isinstance(too_long, OpenAIError) and too_long.status_code == 400 and "2000000 token ids" in str(too_long)
    dense = results["500k logit_bias entries (6 MiB)"][0]
    assert isinstance(dense, OpenAIError) and dense.status_code == 413 and str(MAX_VALUES) in str(dense)
    assert results["500k metadata entries (8 MiB)"][0] == {"prompt": "hi"}  # checked, then dropped: ignored anyway
    assert results["12 MB of text"][0]["prompt"] == "hello world " * 1_000_000
    bad = results["not JSON"][0]
    assert isinstance(bad, OpenAIError) and bad.status_code == 400 and "not valid JSON" in str(bad)


def test_a_parser_process_that_died_is_started_afresh_even_mid_body():
    async def run():
        parser = BodyParser()
        try:
            assert await parser.loads(b"[1]", 10) == [1]
            first = parser.process.pid
            parser.process.kill()
            parser.process.wait()
            assert await parser.loads(b'{"prompt": [3]}', 10) == {"prompt": [3]}
            assert parser.process.pid != first
            big = json.dumps({"prompt": list(range(1, 2_000_001))}).encode()
            parsing = asyncio.create_task(parser.loads(big, 10))
            await asyncio.sleep(0.05)
            second = parser.process.pid
            parser.process.kill()  # mid-body: a fresh process parses it (refused: longer than 10 ids)
            with pytest.raises(OpenAIError) as failed:
                await parsing
            assert failed.value.status_code == 400 and "2000000 token ids" in str(failed.value)
            assert parser.process.pid != second
            assert await parser.loads(b"[4]", 10) == [4]
        finally:
            parser.close()

    asyncio.run(run())


def test_a_body_whose_request_was_cancelled_does_not_garble_the_next():
    """A client that goes away while its body is parsed cancels its request; the exchange with the
    parser process finishes on its thread before the next body uses the connection."""

    async def run():
        parser = BodyParser()
        try:
            big = json.dumps({"prompt": list(range(1, 1_000_001))}).encode()
            for _ in range(3):
                asking = asyncio.create_task(parser.loads(big, 2_000_000))
                await asyncio.sleep(0.02)
                asking.cancel()
                assert await parser.loads(b'{"prompt": [5, 6]}', 10) == {"prompt": [5, 6]}
        finally:
            parser.close()

    asyncio.run(run())
