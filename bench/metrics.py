"""Serving-benchmark statistics: per-request latencies, percentiles, throughput and goodput.

Definitions follow `vllm bench serve`, so numbers compare with it:
- TTFT: from sending a request to its first chunk that carries tokens.
- ITL: the gaps between consecutive chunks that carry tokens (all requests pooled).
- E2E: from sending a request to its last chunk that carries tokens.
- TPOT: (E2E - TTFT) / (output tokens - 1), for requests with more than one output token.
- Goodput (`--goodput ttft:MS tpot:MS e2el:MS`, any subset): the requests that met every given
  SLO (metric <= SLO; a one-token request counts as TPOT 0) per second of benchmark duration.
- Throughputs count successful requests only, over the benchmark duration (first send to last answer).
Torch-free, no numpy: percentiles interpolate linearly between order statistics (numpy's default).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

GOODPUT_KEYS = ("ttft", "tpot", "e2el")
PERCENTILES = (50, 90, 99)


@dataclass
class RequestResult:
    """One request as the client saw it; times in seconds."""

    prompt_len: int
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    success: bool = False
    error: str = ""
    cached_tokens: int | None = None  # prompt tokens served from the prefix cache, when the server says
    kv_transfer_bytes: int | None = None  # KV written prefill -> decode for it, when the server says (/generate)

    @property
    def tpot(self) -> float:
        """Mean time per output token after the first; 0 for one-token requests (vLLM's goodput rule)."""
        if self.output_tokens <= 1:
            return 0.0
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def percentile(values: list[float], p: float) -> float:
    """The p-th percentile (0..100), linear between the two nearest ranks; 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100.0
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def latency_summary(seconds: list[float]) -> dict:
    """mean and percentiles, in milliseconds."""
    summary = {"mean": sum(seconds) / len(seconds) * 1e3 if seconds else 0.0}
    for p in PERCENTILES:
        summary[f"p{p}"] = percentile(seconds, p) * 1e3
    return summary


def parse_goodput(items: list[str]) -> dict[str, float]:
    """`["ttft:200", "tpot:50"]` -> {"ttft": 200.0, "tpot": 50.0} (milliseconds)."""
    slos = {}
    for item in items:
        key, sep, value = item.partition(":")
        if not sep or key not in GOODPUT_KEYS:
            raise ValueError(f"--goodput takes KEY:MS with KEY one of {', '.join(GOODPUT_KEYS)}; got {item!r}")
        try:
            slos[key] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of milliseconds") from None
        if not slos[key] >= 0:
            raise ValueError(f"--goodput {item!r}: the SLO must be >= 0 ms")
    return slos


def is_good(result: RequestResult, slos_ms: dict[str, float]) -> bool:
    """Whether a successful request met every SLO (compared in seconds, as vLLM does)."""
    metrics = {"ttft": result.ttft, "tpot": result.tpot, "e2el": result.e2e}
    for key, slo in slos_ms.items():
        if metrics[key] > slo / 1000.0:
            return False
    return True


def summarize(results: list[RequestResult], duration_s: float, slos_ms: dict[str, float]) -> dict:
    """The benchmark's numbers: counts, throughputs, goodput and latency summaries (ms)."""
    ok = [r for r in results if r.success]
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    itls = [gap for r in ok for gap in r.itl]
    summary = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration_s,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration_s,
        "output_throughput": output_tokens / duration_s,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s,
        "request_goodput": None,
        "ttft_ms": latency_summary([r.ttft for r in ok]),
        "tpot_ms": latency_summary([r.tpot for r in ok if r.output_tokens > 1]),
        "itl_ms": latency_summary(itls),
        "e2el_ms": latency_summary([r.e2e for r in ok]),
        "total_cached_tokens": None,  # unknown unless every request's usage said
        "prefix_cache_hit_rate": None,
    }
    if ok and all(r.cached_tokens is not None for r in ok):
        summary["total_cached_tokens"] = sum(r.cached_tokens for r in ok)
        summary["prefix_cache_hit_rate"] = summary["total_cached_tokens"] / input_tokens
    summary["slo_attainment"] = None
    if slos_ms:
        good = sum(1 for r in ok if is_good(r, slos_ms))
        summary["request_goodput"] = good / duration_s
        summary["slo_attainment"] = good / len(results) if results else None  # failed requests miss them
    return summary
