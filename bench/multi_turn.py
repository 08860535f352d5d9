"""Multi-turn conversations for `pdserve bench serve --conversations N --turns T`: chat and agent
traffic, where every turn resends the whole conversation.

Each conversation starts with a system prompt shared by all of them (--system-len tokens), then
takes T turns: its prompt is the previous turn's prompt, that turn's answer (the ids the server
generated, --output-len of them) and a new user message (--user-len random ids); between turns the
user thinks (exponential, mean --think-time s). Conversations start as --request-rate says (all at
once by default), at most --max-concurrency at a time. Sent to the router's native /generate (token
ids in and out, streamed), from this process. Reported per turn index: TTFT, prompt length and the
prompt tokens served from a prefix cache, which grow with the history a server kept.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import time
from dataclasses import dataclass

from pdserve.bench.http_client import post_events
from pdserve.bench.loadgen import arrival_times
from pdserve.bench.metrics import RequestResult, latency_summary, summarize
from pdserve.bench.proc_cpu import cpu_per_1k_tokens, process_cpu_s, process_tree_cpu_s
from pdserve.bench.report import table


@dataclass
class MultiTurn:
    conversations: int
    turns: int
    system_len: int
    user_len: int
    output_len: int
    think_time_s: float


async def generate(url: str, headers: dict, prompt: list[int], output_len: int, timeout_s: float):
    """One streamed /generate: (its RequestResult, the output ids; [] when it failed)."""
    result, start, output_ids = RequestResult(prompt_len=len(prompt)), time.perf_counter(), []
    payload = {
        "input_ids": prompt,
        "stream": True,
        "sampling_params": {"max_tokens": output_len, "temperature": 0.0, "ignore_eos": True},
    }

    async def read() -> None:
        nonlocal output_ids
        last = None
        async for stamp, data in post_events(url, payload, headers):
            if data == "[DONE]":
                break
            item = json.loads(data)
            if "error" in item:
                raise RuntimeError(f"server error: {item['error']}")
            if "output_ids" in item:  # the last item: the ids, the finish and the usage
                output_ids = item["output_ids"]
                usage = item.get("usage") or {}
                result.cached_tokens, result.kv_transfer_bytes = (
                    usage.get("cached_tokens"),
                    usage.get("kv_transfer_bytes"),
                )
                stamp = last or stamp
            if last is None:
                result.ttft = stamp - start
            elif stamp != last:
                result.itl.append(stamp - last)
            last = stamp
        result.e2e = (last or time.perf_counter()) - start

    try:
        await asyncio.wait_for(read(), timeout_s)
    except Exception as e:  # noqa: BLE001 - any failure of one turn is that turn's result
        result.error = f"{type(e).__name__}: {e}"
        return result, []
    result.output_tokens = len(output_ids)
    if len(output_ids) != output_len:
        result.error = f"{len(output_ids)} output tokens, expected {output_len}"
        return result, []
    result.success = True
    return result, output_ids


async def run_conversations(
    base_url: str, headers: dict, spec: MultiTurn, pool: list[int], rate: float, max_concurrency: int, seed: int,
    timeout_s: float,
) -> tuple[list[list[RequestResult]], float]:  # fmt: skip
    """Every conversation's turns' results (a conversation ends at its first failed turn: the next
    needs its answer), and the duration from the first request to the last answer."""
    url = base_url.rstrip("/") + "/generate"
    rng = random.Random(seed)
    system = [rng.choice(pool) for _ in range(spec.system_len)]
    users = [
        [[rng.choice(pool) for _ in range(spec.user_len)] for _ in range(spec.turns)] for _ in range(spec.conversations)
    ]
    thinks = [[rng.expovariate(1 / spec.think_time_s) if spec.think_time_s > 0 else 0.0 for _ in range(spec.turns)]
              for _ in range(spec.conversations)]  # fmt: skip
    slots = asyncio.Semaphore(max_concurrency or spec.conversations)
    start = time.perf_counter()

    async def converse(c: int, offset: float) -> list[RequestResult]:
        await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
        results, history = [], list(system)
        async with slots:
            for t in range(spec.turns):
                prompt = history + users[c][t]
                result, output_ids = await generate(url, headers, prompt, spec.output_len, timeout_s)
                results.append(result)
                if not result.success:
                    break
                history = prompt + output_ids
                if t + 1 < spec.turns and thinks[c][t]:
                    await asyncio.sleep(thinks[c][t])
        return results

    offsets = arrival_times(spec.conversations, rate, seed)
    conversations = await asyncio.gather(*(converse(c, offsets[c]) for c in range(spec.conversations)))
    return conversations, time.perf_counter() - start


def mean(values: list) -> float | None:
    return sum(values) / len(values) if values else None


def per_turn(conversations: list[list[RequestResult]], turns: int) -> list[dict]:
    """By turn index: answered turns, mean prompt length, cached prompt tokens (mean and share), the
    KV bytes the prefill server wrote to the decode server (mean), TTFT."""
    rows = []
    for t in range(turns):
        ok = [c[t] for c in conversations if len(c) > t and c[t].success]
        cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
        prompt = sum(r.prompt_len for r in ok)
        rows.append(
            {
                "turn": t + 1,
                "completed": len(ok),
                "mean_prompt_len": prompt / len(ok) if ok else 0.0,
                "mean_cached_tokens": mean(cached),
                "cached_share": sum(cached) / prompt if cached and len(cached) == len(ok) and prompt else None,
                "mean_kv_transfer_bytes": mean([r.kv_transfer_bytes for r in ok if r.kv_transfer_bytes is not None]),
                "ttft_ms": latency_summary([r.ttft for r in ok]),
            }
        )
    return rows


def check_multi_turn(args: argparse.Namespace) -> None:
    if not args.conversations:
        return
    if args.conversations < 0 or args.turns < 1 or args.system_len < 0 or args.user_len < 1 or args.think_time < 0:
        raise ValueError(
            "--conversations >= 1 needs --turns >= 1, --system-len >= 0, --user-len >= 1, --think-time >= 0"
        )
    if args.backend == "hf" or args.client_workers > 1 or args.stacks:
        raise ValueError("--conversations runs here over HTTP: no --backend hf, --client-workers or --stacks")


async def multi_turn_run(backend, args, pool: list[int], rate: float, concurrency: int, slos: dict, router_pid):
    """One multi-turn run (bench/multi_turn.py): the usual summary over every turn, and per turn index."""
    spec = MultiTurn(args.conversations, args.turns, args.system_len, args.user_len, args.output_len, args.think_time)
    print(f"measuring: {spec.conversations} conversations x {spec.turns} turns, rate {rate}", flush=True)
    client, router = process_cpu_s(None), process_tree_cpu_s(router_pid) if router_pid else None
    conversations, duration = await run_conversations(
        backend.base_url, backend.headers, spec, pool, rate, concurrency, args.seed, args.request_timeout
    )
    results = [r for turns in conversations for r in turns]
    run = {
        "request_rate": "inf" if math.isinf(rate) else rate,
        "max_concurrency": concurrency or None,
        **summarize(results, duration, slos),
    }
    tokens = run["total_output_tokens"]
    run["client_cpu_s_per_1k_tokens"] = cpu_per_1k_tokens(client, process_cpu_s(None), tokens)
    run["router_cpu_s_per_1k_tokens"] = (
        cpu_per_1k_tokens(router, process_tree_cpu_s(router_pid), tokens) if router_pid else None
    )
    run["errors"] = sorted({r.error for r in results if not r.success})[:5]
    run["turns"] = per_turn(conversations, spec.turns)
    return run


def print_turns(turns: list[dict]) -> None:
    header = ["turn", "answered", "mean prompt", "mean cached", "cached share", "KV sent", "TTFT p50", "TTFT p90"]
    rows = [
        [
            t["turn"],
            t["completed"],
            f"{t['mean_prompt_len']:.0f}",
            "-" if t["mean_cached_tokens"] is None else f"{t['mean_cached_tokens']:.0f}",
            "-" if t["cached_share"] is None else f"{t['cached_share']:.1%}",
            "-" if t["mean_kv_transfer_bytes"] is None else f"{t['mean_kv_transfer_bytes'] / 1024:.1f} KiB",
            f"{t['ttft_ms']['p50']:.2f}",
            f"{t['ttft_ms']['p90']:.2f}",
        ]
        for t in turns
    ]
    print(table(header, rows) + "\n  (latencies in ms)\n", flush=True)


def multi_turn_report(args: argparse.Namespace) -> dict | None:
    """The workload's shape for the JSON report; None without --conversations."""
    if not args.conversations:
        return None
    fields = ("conversations", "turns", "system_len", "user_len")
    return {name: getattr(args, name) for name in fields} | {"think_time_s": args.think_time}
