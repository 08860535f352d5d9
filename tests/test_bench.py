"""`pdserve bench offline|serve`: the statistics on hand-made numbers, the random-weight cache, the
load generator with fake backends and a canned HTTP server, and both commands end to end on tiny
models (offline: engine and transformers; serve: a real local stack, and transformers in-process)."""

import asyncio
import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open

from pdserve.bench import random_weights
from pdserve.bench.client_workers import ClientWorkers, split_concurrency
from pdserve.bench.hf import check_generated
from pdserve.bench.loadgen import Chunk, OpenAIBackend, arrival_times, run_schedule, timed_request
from pdserve.bench.metrics import RequestResult, is_good, parse_goodput, percentile, summarize
from pdserve.bench.offline import check_completions
from pdserve.bench.stack import engine_flags, server_configs
from pdserve.bench.workload import Lengths, random_prompts
from pdserve.common.cli import main
from pdserve.common.config import EngineConfig
from pdserve.common.types import FinishReason
from pdserve.router.placement import plan_placement


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A private $PDSERVE_CACHE for the commands run here."""
    root = tmp_path_factory.mktemp("pdserve-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PDSERVE_CACHE", str(root))
        yield root


def report_of(capsys) -> dict:
    out = capsys.readouterr().out
    return json.loads(out.strip().splitlines()[-1])


# ---- statistics ---------------------------------------------------------------------------------


def test_percentiles_interpolate_linearly():
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 50) == 2.5
    assert percentile(values, 90) == pytest.approx(3.7)
    assert percentile(values, 99) == pytest.approx(3.97)
    assert (percentile(values, 0), percentile(values, 100)) == (1.0, 4.0)
    assert percentile([5.0], 99) == 5.0
    assert percentile([], 50) == 0.0
    assert percentile(list(range(101)), 90) == 90.0


def result(ttft, e2e, tokens, itl=(), success=True, prompt_len=10):
    return RequestResult(prompt_len, tokens, ttft, e2e, list(itl), success)


def test_tpot_and_goodput_follow_vllm():
    slos = parse_goodput(["ttft:100", "tpot:20"])
    assert slos == {"ttft": 100.0, "tpot": 20.0}
    assert result(0.050, 0.250, 11).tpot == pytest.approx(0.020)  # (0.25 - 0.05) / 10
    results = [
        result(0.050, 0.250, 11),  # tpot 20 ms, ttft 50 ms: both SLOs met exactly/under -> good
        result(0.100, 0.150, 6),   # ttft exactly 100 ms, tpot 10 ms -> good
        result(0.101, 0.150, 6),   # ttft over -> bad
        result(0.050, 0.550, 11),  # tpot 50 ms -> bad
        result(0.900, 0.900, 1),   # ttft over; its tpot counts as 0
        result(0.010, 0.010, 1),   # one token: tpot 0 -> good
        result(0.0, 0.0, 0, success=False),  # failed: never good, not counted anywhere
    ]  # fmt: skip
    assert [is_good(r, slos) for r in results[:6]] == [True, True, False, False, False, True]
    assert is_good(results[3], {"e2el": 550.0}) and not is_good(results[3], {"e2el": 549.9})
    summary = summarize(results, duration_s=2.0, slos_ms=slos)
    assert summary["completed"] == 6 and summary["failed"] == 1
    assert summary["request_goodput"] == 3 / 2.0
    assert summary["request_throughput"] == 6 / 2.0
    assert summary["total_output_tokens"] == 11 + 6 + 6 + 11 + 1 + 1
    assert summary["output_throughput"] == 36 / 2.0
    assert summary["total_token_throughput"] == (60 + 36) / 2.0
    assert summary["ttft_ms"]["p50"] == pytest.approx(75.0)  # of 10, 50, 50, 100, 101, 900
    assert summary["tpot_ms"]["mean"] == pytest.approx((20 + 10 + 9.8 + 50) / 4)  # one-token requests left out
    assert summarize(results, 2.0, {})["request_goodput"] is None


def test_prefix_cache_hits_are_summed_when_every_request_reports_them():
    results = [result(0.01, 0.02, 2, prompt_len=100), result(0.01, 0.02, 2, prompt_len=100)]
    assert summarize(results, 1.0, {})["prefix_cache_hit_rate"] is None  # the server did not say
    results[0].cached_tokens, results[1].cached_tokens = 80, 0
    summary = summarize(results, 1.0, {})
    assert summary["total_cached_tokens"] == 80 and summary["prefix_cache_hit_rate"] == pytest.approx(0.4)


def test_prompts_share_prefixes_by_group_picked_at_random():
    pool = list(range(1000))
    plain = random_prompts(pool, 5, 12, seed=3, run=0)
    assert plain == random_prompts(pool, 5, 12, seed=3, run=0) and all(len(p) == 12 for p in plain)
    shared = random_prompts(pool, 200, 12, seed=3, run=0, prefix_groups=4, prefix_len=8)
    assert all(len(p) == 12 for p in shared)
    prefixes = [tuple(p[:8]) for p in shared]
    counts = sorted(prefixes.count(x) for x in set(prefixes))
    assert len(counts) == 4 and counts[0] > 20  # every group used, about 50 each
    group = {x: i for i, x in enumerate(dict.fromkeys(prefixes))}  # numbered by first appearance
    assert [group[x] for x in prefixes[:8]] != [i % 4 for i in range(8)]  # not in turn
    assert len({tuple(p[8:]) for p in shared}) == 200  # suffixes differ
    assert random_prompts(pool, 200, 12, seed=3, run=1, prefix_groups=4, prefix_len=8)[0][:8] not in [
        list(x) for x in prefixes
    ]


def test_itl_pools_every_gap():
    summary = summarize([result(0.1, 0.3, 3, itl=[0.1, 0.1]), result(0.1, 0.5, 3, itl=[0.1, 0.3])], 1.0, {})
    assert summary["itl_ms"]["mean"] == pytest.approx(150.0)
    assert summary["itl_ms"]["p50"] == pytest.approx(100.0)


@pytest.mark.parametrize("bad", ["ttft", "itl:5", "ttft:x", "tpot:-1"])
def test_goodput_rejects_bad_slos(bad):
    with pytest.raises(ValueError):
        parse_goodput([bad])


def test_arrivals_poisson_or_all_at_once():
    assert arrival_times(3, math.inf, 0) == [0.0, 0.0, 0.0]
    times = arrival_times(2000, 50.0, seed=7)
    assert times == arrival_times(2000, 50.0, seed=7) and times[0] == 0.0
    assert all(b >= a for a, b in zip(times, times[1:]))
    assert times[-1] / (len(times) - 1) == pytest.approx(1 / 50.0, rel=0.1)  # mean gap 20 ms


# ---- the load generator, with fake backends -----------------------------------------------------


class FakeBackend:
    """`tokens` chunks `gap` seconds apart, then the usage; records the concurrency it saw."""

    def __init__(self, tokens=3, gap=0.01, usage=None, fail=False):
        self.tokens, self.gap, self.usage, self.fail = tokens, gap, usage, fail
        self.inflight = self.most = 0
        self.sent = []

    async def stream(self, prompt, output_len):
        self.sent.append(time.perf_counter())
        self.inflight += 1
        self.most = max(self.most, self.inflight)
        try:
            if self.fail:
                raise ConnectionError("refused")
            for _ in range(self.tokens):
                await asyncio.sleep(self.gap)
                yield Chunk(time.perf_counter(), tokens=True)
            yield Chunk(time.perf_counter(), tokens=False, usage_tokens=self.usage or self.tokens)
        finally:
            self.inflight -= 1


def test_timed_request_measures_and_fails_loudly():
    ok = asyncio.run(timed_request(FakeBackend(tokens=3, gap=0.02), [1, 2], 3, timeout_s=5))
    assert ok.success and ok.output_tokens == 3 and len(ok.itl) == 2
    assert 0.015 < ok.ttft < ok.e2e and ok.e2e == pytest.approx(ok.ttft + sum(ok.itl))
    short = asyncio.run(timed_request(FakeBackend(tokens=2), [1], 3, timeout_s=5))
    assert not short.success and "2 output tokens reported, expected 3" in short.error
    refused = asyncio.run(timed_request(FakeBackend(fail=True), [1], 3, timeout_s=5))
    assert not refused.success and "ConnectionError" in refused.error
    slow = asyncio.run(timed_request(FakeBackend(tokens=3, gap=0.5), [1], 3, timeout_s=0.1))
    assert not slow.success and "TimeoutError" in slow.error


def test_schedule_keeps_the_concurrency_limit_and_the_arrivals():
    backend = FakeBackend(tokens=2, gap=0.01)
    results, duration = asyncio.run(run_schedule(backend, [[1]] * 8, 2, math.inf, 3, seed=0, timeout_s=5))
    assert backend.most == 3 and all(r.success for r in results) and duration > 0
    backend = FakeBackend(tokens=1, gap=0.0)
    start = time.perf_counter()
    asyncio.run(run_schedule(backend, [[1]] * 6, 1, 40.0, 0, seed=3, timeout_s=5))
    offsets = arrival_times(6, 40.0, seed=3)
    for sent, offset in zip(backend.sent, offsets):
        assert sent - start >= offset - 0.002


async def canned_server(handler):
    """A one-response-per-connection HTTP server: handler(request head) -> raw response bytes."""

    async def serve(reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(
            next((line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")), 0)
        )
        body = await reader.readexactly(length)
        writer.write(handler(head, body))
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


def sse_response(events: list[str]) -> bytes:
    chunks = b""
    for event in events:
        data = f"data: {event}\n\n".encode()
        chunks += f"{len(data):x}\r\n".encode() + data + b"\r\n"
    return (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
        + chunks
        + b"0\r\n\r\n"
    )


def test_openai_backend_parses_a_chunked_sse_stream_and_http_errors():
    seen = []

    def handler(head, body):
        seen.append(json.loads(body))
        if b"Bearer nope" in head:
            error = b'{"error": {"message": "bad key"}}'
            return b"HTTP/1.1 401 Unauthorized\r\ncontent-length: %d\r\n\r\n%s" % (len(error), error)

        def choice(text, finish=None):
            return json.dumps({"choices": [{"index": 0, "text": text, "finish_reason": finish}]})

        usage = json.dumps(
            {"choices": [], "usage": {"completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 1}}}
        )
        return sse_response([choice("a"), choice(""), choice("bc"), choice("", "length"), usage, "[DONE]"])

    async def scenario():
        server, url = await canned_server(handler)
        async with server:
            good = await timed_request(OpenAIBackend(url, "m"), [5, 6], 3, timeout_s=5)
            bad = await timed_request(OpenAIBackend(url, "m", api_key="nope"), [5], 3, timeout_s=5)
        return good, bad

    good, bad = asyncio.run(scenario())
    assert good.success and good.output_tokens == 3 and len(good.itl) == 1  # two chunks carried text
    assert good.cached_tokens == 1
    assert not bad.success and "HTTP 401" in bad.error and "bad key" in bad.error
    assert seen[0] == {
        "model": "m",
        "prompt": [5, 6],
        "max_tokens": 3,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def test_client_workers_deal_requests_round_robin_and_merge_them_in_prompt_order():
    def handler(head, body):
        tokens = json.loads(body)["max_tokens"]
        text, usage = json.dumps({"choices": [{"text": "x"}]}), json.dumps({"usage": {"completion_tokens": tokens}})
        return sse_response([text] * tokens + [usage, "[DONE]"])

    prompts = [[7] * n for n in range(1, 6)]  # the prompt length tells the results apart
    lens = [3, 1, 4, 1, 5]

    async def scenario():
        server, url = await canned_server(handler)
        async with server:
            with ClientWorkers(2, OpenAIBackend(url, "m")) as workers:
                both = await asyncio.to_thread(workers.run, prompts, 2, math.inf, 3, 0, 10.0)
                one = await asyncio.to_thread(workers.run, prompts[:3], 2, 100.0, 1, 0, 10.0)  # limit 1: one worker
                mixed = await asyncio.to_thread(workers.run, prompts, lens, math.inf, 0, 0, 10.0)  # one per request
        return both, one, mixed

    (results, duration, cpu_s), (alone, _, _), (mixed, _, _) = asyncio.run(scenario())
    assert [(r.prompt_len, r.output_tokens) for r in mixed] == list(zip(range(1, 6), lens))  # dealt with its prompt
    assert all(r.success for r in mixed)
    assert [r.prompt_len for r in results] == [1, 2, 3, 4, 5]
    assert all(r.success and r.output_tokens == 2 and len(r.itl) == 1 for r in results)
    assert duration > 0 and cpu_s > 0  # the workers' own CPU time
    assert [r.prompt_len for r in alone] == [1, 2, 3] and all(r.success for r in alone)
    assert split_concurrency(5, 2) == [3, 2] and split_concurrency(3, 3) == [1, 1, 1]
    assert split_concurrency(0, 3) == [0, 0, 0]  # no limit stays no limit


# ---- exact token counts -------------------------------------------------------------------------


def test_short_outputs_fail_loudly():
    done = SimpleNamespace(rid="r0", output_ids=[1, 2, 3], finish_reason=FinishReason.LENGTH, error=None)
    check_completions([done], 3)
    short = SimpleNamespace(rid="r1", output_ids=[1, 2], finish_reason=FinishReason.STOP, error=None)
    with pytest.raises(RuntimeError, match="r1 produced 2 tokens, expected 3"):
        check_completions([done, short], 3)
    check_generated([[7, 8, 9]], 3, eos={1})
    with pytest.raises(RuntimeError, match="EOS"):
        check_generated([[7, 1, 2]], 3, eos={1})  # stopped at EOS, then padded (pad id 2)
    with pytest.raises(RuntimeError, match="2 tokens"):
        check_generated([[7, 8]], 3, eos={1})


# ---- random-weight checkpoints ------------------------------------------------------------------


def test_random_weight_cache_is_built_once_and_rebuilt_when_stale(tmp_path, monkeypatch):
    path = random_weights.random_weight_checkpoint("gpt2/tiny", root=tmp_path)
    assert path == tmp_path / "gpt2-tiny" and (path / "model.safetensors").is_file()
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    real, built = random_weights.write_checkpoint, []

    def counting(*args):
        built.append(args)
        real(*args)

    monkeypatch.setattr(random_weights, "write_checkpoint", counting)
    assert random_weights.random_weight_checkpoint("gpt2/tiny", root=tmp_path) == path
    assert built == [] and (path / "model.safetensors").stat().st_mtime_ns == stamp
    recipe = json.loads((path / random_weights.RECIPE_FILE).read_text())
    (path / random_weights.RECIPE_FILE).write_text(json.dumps({**recipe, "version": 0}))
    assert random_weights.random_weight_checkpoint("gpt2/tiny", root=tmp_path) == path
    assert len(built) == 1 and json.loads((path / random_weights.RECIPE_FILE).read_text()) == recipe
    assert [p.name for p in tmp_path.iterdir()] == ["gpt2-tiny"]  # no staging directory left behind
    with pytest.raises(ValueError, match="unknown shape"):
        random_weights.random_weight_checkpoint("gpt2/huge", root=tmp_path)


def test_full_size_shapes_are_bf16_with_a_tokenizer_as_wide_as_the_vocab(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    overrides = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "vocab_size": 700,
        "tie_word_embeddings": True,
    }
    random_weights.write_checkpoint(tmp_path, "llama", overrides)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
        assert f.get_slice("model.embed_tokens.weight").get_shape() == [700, 32]
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert len(tokenizer) == 700 and tokenizer.decode([600, 699]) == f" t{600 - 512} t{699 - 512}"
    assert (
        tokenizer("The quick brown fox")["input_ids"]
        == AutoTokenizer.from_pretrained(random_weights.random_weight_checkpoint("llama/tiny", root=tmp_path / "tiny"))(
            "The quick brown fox"
        )["input_ids"]
    )
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert model.config.vocab_size == 700 and model.config.hidden_size == 32


# ---- the commands -------------------------------------------------------------------------------


def test_offline_both_backends_on_a_tiny_model(cache, tmp_path, capsys):
    out = tmp_path / "offline.json"
    argv = [
        "bench",
        "offline",
        "--random-weights",
        "qwen3/tiny",
        "--num-prompts",
        "4",
        "--input-len",
        "8",
        "--output-len",
        "4",
        "--backend",
        "both",
        "--warmup",
        "1",
        "--repeats",
        "2",
        "--device",
        "cpu",
        "--disable-overlap-schedule",
        "--output-json",
        str(out),
    ]
    assert main(argv) == 0
    out_text = capsys.readouterr().out
    report = json.loads(out_text.strip().splitlines()[-1])
    assert report == json.loads(out.read_text())
    assert report["command"] == "pdserve " + " ".join(argv)
    # The backends take turns, run by run, so a slow stretch of the machine hits both.
    order = [line.split()[0] for line in out_text.splitlines() if re.match(r"\w+ (run|warmup) \d+/\d+: ", line)]
    assert order == ["hf", "pdserve"] * 3, order
    assert (report["device"], report["dtype"], report["random_weights"]) == ("cpu", "float32", "qwen3/tiny")
    assert report["engine_config"]["disable_overlap_schedule"] is True
    for backend in ("pdserve", "hf"):
        runs = report["backends"][backend]["runs"]
        assert [r["warmup"] for r in runs] == [True, False, False]
        for r in runs:
            assert r["output_tok_s"] == pytest.approx(16 / r["elapsed_s"])
            assert r["total_tok_s"] == pytest.approx(48 / r["elapsed_s"]) and r["req_s"] > 0
        assert report["backends"][backend]["median"]["output_tok_s"] > 0
    ratio = report["backends"]["pdserve"]["median"]["output_tok_s"] / report["backends"]["hf"]["median"]["output_tok_s"]
    assert report["pdserve_over_hf_output_tok_s"] == pytest.approx(ratio)
    pdserve_runs, hf_runs = report["backends"]["pdserve"]["runs"][1:], report["backends"]["hf"]["runs"][1:]
    paired = sorted(p["output_tok_s"] / h["output_tok_s"] for p, h in zip(pdserve_runs, hf_runs))
    assert report["pdserve_over_hf_paired_median"] == pytest.approx((paired[0] + paired[1]) / 2)


def test_bad_options_exit_2(cache, capsys):
    assert main(["bench", "offline", "--device", "cpu"]) == 2
    assert "--random-weights" in capsys.readouterr().err
    assert main(["bench", "offline", "--random-weights", "gpt2/medium"]) == 2
    assert main(["bench", "serve", "--backend", "hf", "--base-url", "http://127.0.0.1:9"]) == 2
    assert main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--goodput", "ttft"]) == 2
    assert (
        main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--vocab-size", "100", "--num-prefill", "2"]) == 2
    )
    assert "local stack" in capsys.readouterr().err
    assert (
        main(["bench", "serve", "--backend", "hf", "--random-weights", "llama/tiny", "--prefill-policy", "cache_aware"])
        == 2
    )
    assert "local stack" in capsys.readouterr().err
    for placement in (["--num-decode", "2"], ["--decode-tp", "2"], ["--gpus", "0"]):
        assert main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--vocab-size", "100", *placement]) == 2
        assert "local stack" in capsys.readouterr().err
    local = ["bench", "serve", "--random-weights", "llama/tiny", "--device", "cpu"]
    assert main([*local, "--num-decode", "0"]) == 2  # the placement refuses it before anything starts
    assert "--num-decode must be >= 1" in capsys.readouterr().err
    assert main([*local, "--gpus", "0"]) == 2
    assert "--device cpu" in capsys.readouterr().err
    remote = ["bench", "serve", "--base-url", "http://127.0.0.1:9", "--vocab-size", "100"]
    assert main([*remote, "--client-workers", "0"]) == 2
    assert "--client-workers must be >= 1" in capsys.readouterr().err
    assert main(["bench", "serve", "--backend", "hf", "--random-weights", "llama/tiny", "--client-workers", "2"]) == 2
    assert "--backend hf" in capsys.readouterr().err
    assert main([*remote, "--router-pid", str(2**22 + 12345)]) == 2
    assert "no such process" in capsys.readouterr().err
    assert main(["bench", "serve", "--random-weights", "llama/tiny", "--router-pid", "1"]) == 2
    assert "--base-url" in capsys.readouterr().err
    for prefix in (["--prefix-groups", "4"], ["--prefix-len", "8"], ["--prefix-groups", "4", "--prefix-len", "256"]):
        assert main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--vocab-size", "100", *prefix]) == 2
        assert "--prefix-len" in capsys.readouterr().err


def test_engine_flags_reach_the_local_servers():
    config = EngineConfig(model_path="/m", device="cpu", max_total_tokens=4096, disable_overlap_schedule=True)
    assert engine_flags(config) == [
        "--model-path",
        "/m",
        "--device",
        "cpu",
        "--max-total-tokens",
        "4096",
        "--disable-overlap-schedule",
    ]
    # Each server's config: its role's TP size, its device, its share of a GPU it shares (router/placement.py).
    assert server_configs(config, plan_placement([], 1, 1, 1, 2), "cpu", {"prefill": 1, "decode": 2}) == [
        dataclasses.replace(config, tp_size=2),
        config,
    ]
    tp1 = {"prefill": 1, "decode": 1}
    on_one_gpu = server_configs(EngineConfig(model_path="/m"), plan_placement([0], 3, 1, 1, 1), "cuda", tp1)
    assert [(c.device, c.mem_fraction_static) for c in on_one_gpu] == [
        ("cuda", 0.2125),
        ("cuda", 0.425),
        ("cuda", 0.6375),
        ("cuda", 0.85),
    ]
    explicit = dataclasses.replace(config, device="auto")  # --max-total-tokens: every server as given
    assert [c.mem_fraction_static for c in server_configs(explicit, plan_placement([0], 1, 1, 1, 1), "cuda", tp1)] == [
        0,
        0,
    ]
    # --decode-max-total-tokens: the decode server's pool (first in the plan), the prefill server's as before.
    plan = plan_placement([0], 1, 1, 1, 1)
    sized = server_configs(explicit, plan, "cuda", tp1, decode_max_total_tokens=65536)
    assert [(p.role, c.max_total_tokens, c.mem_fraction_static) for p, c in zip(plan, sized)] == [
        ("decode", 65536, 0),
        ("prefill", 4096, 0),
    ]
    only_decode = server_configs(EngineConfig(model_path="/m"), plan, "cuda", tp1, decode_max_total_tokens=65536)
    assert [(c.max_total_tokens, c.mem_fraction_static) for c in only_decode] == [(65536, 0), (0, 0.85)]


def check_serve_runs(report, runs, requests, output_len, output_tokens=None):
    """output_tokens: each run's total (drawn lengths); default requests x output_len."""
    assert [(r["request_rate"], r["max_concurrency"]) for r in report["runs"]] == runs
    for i, r in enumerate(report["runs"]):
        assert (r["completed"], r["failed"], r["errors"]) == (requests, 0, [])
        assert r["total_output_tokens"] == (requests * output_len if output_tokens is None else output_tokens[i])
        assert 0 < r["ttft_ms"]["p50"] <= r["e2el_ms"]["p50"] <= r["e2el_ms"]["p99"]
        assert r["tpot_ms"]["mean"] > 0 and r["output_throughput"] > 0
        assert r["request_goodput"] == pytest.approx(r["request_throughput"])  # a 60 s SLO: all good


def test_serve_against_a_local_stack_it_starts(cache, capsys):
    argv = [
        "bench",
        "serve",
        "--random-weights",
        "llama/tiny",
        "--num-prompts",
        "6",
        "--input-len",
        "24",
        "--output-len",
        "4",
        "--request-rate",
        "40",
        "inf",
        "--max-concurrency",
        "0",
        "2",
        "--device",
        "cpu",
        "--max-total-tokens",
        "4096",
        "--disable-overlap-schedule",
        "--goodput",
        "ttft:60000",
        "e2el:60000",
        "--num-prefill",
        "2",
        "--prefill-policy",
        "cache_aware",
        "--prefix-groups",
        "2",
        "--prefix-len",
        "16",
        "--page-size",
        "4",
    ]
    assert main(argv) == 0
    report = report_of(capsys)
    assert report["backend"] == "pdserve" and report["base_url"] is None and report["device"] == "cpu"
    # the router serves it under its short name (the checkpoint directory's)
    assert report["model"] == os.path.basename(report["model_path"].rstrip("/"))
    assert (report["num_prefill"], report["prefill_policy"], report["prefix_groups"]) == (2, "cache_aware", 2)
    check_serve_runs(report, [(40.0, None), (40.0, 2), ("inf", None), ("inf", 2)], 6, 4)
    for run in report["runs"]:  # the servers report prefix-cache hits in every answer's usage
        assert 0 <= run["total_cached_tokens"] <= 6 * 16
    assert sum(run["total_cached_tokens"] for run in report["runs"]) > 0
    for run in report["runs"]:  # the client's and the router's CPU time, per 1,000 streamed tokens
        assert run["client_cpu_s_per_1k_tokens"] > 0 and run["router_cpu_s_per_1k_tokens"] >= 0
    # The router's figure counts 10 ms clock ticks, 0 to 3 a run here: some run may see none.
    assert sum(run["router_cpu_s_per_1k_tokens"] for run in report["runs"]) > 0


def test_serve_with_client_workers_merges_their_runs(cache, capsys):
    argv = [
        "bench",
        "serve",
        "--random-weights",
        "llama/tiny",
        "--num-prompts",
        "5",
        "--input-len",
        "12",
        "--output-len",
        "4",
        "--request-rate",
        "inf",
        "--max-concurrency",
        "3",
        "0",
        "--client-workers",
        "2",
        "--device",
        "cpu",
        "--max-total-tokens",
        "4096",
        "--disable-overlap-schedule",
        "--goodput",
        "e2el:60000",
        "--length-dist",  # each request its own drawn lengths, carried through the workers
        "lognormal",
        "--length-sigma",
        "0.6",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    report = json.loads(out.strip().splitlines()[-1])
    assert report["client_workers"] == 2
    draws = [Lengths("lognormal", 12, 4, 0.6, context=report["lengths"]["context"]).draw(5, 0, run) for run in (0, 1)]
    assert any(sum(outs) != 5 * 4 for _, outs in draws)  # not what requests x --output-len would count
    check_serve_runs(report, [("inf", 3), ("inf", None)], 5, 4, [sum(outs) for _, outs in draws])
    assert "5 requests, lognormal lengths, medians 12 -> 4, sigma 0.6; mean " in out
    assert report["lengths"]["mean_output_len"] == pytest.approx(sum(sum(outs) for _, outs in draws) / 10)
    for run, (ins, _) in zip(report["runs"], draws, strict=True):
        assert run["total_input_tokens"] == sum(ins) and len(run) == len(report["runs"][0])
        assert run["client_cpu_s_per_1k_tokens"] > 0 and run["router_cpu_s_per_1k_tokens"] >= 0  # ticks: see above


def test_cpu_seconds_of_a_process_come_from_proc():
    import os
    import subprocess
    import sys

    from pdserve.bench.serve import cpu_per_1k_tokens, process_cpu_s

    busy = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\ntime.sleep(30)",
        ]
    )
    try:
        deadline = 100
        while (process_cpu_s(busy.pid) or 0) < 0.25 and deadline:
            __import__("time").sleep(0.1)
            deadline -= 1
        assert 0.25 <= process_cpu_s(busy.pid) < 5
    finally:
        busy.kill()
        busy.wait()
    assert process_cpu_s(None) > 0 and process_cpu_s(2**22 + 12345) is None  # no such process
    assert cpu_per_1k_tokens(1.0, 3.0, 4000) == 0.5 and cpu_per_1k_tokens(None, 3.0, 10) is None
    assert os.sysconf("SC_CLK_TCK") > 0


def test_cpu_seconds_of_a_process_tree_count_every_descendant_even_one_reaped():
    from pdserve.bench.serve import process_cpu_s, process_tree_cpu_s

    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\ntime.sleep(30)\n"
    supervisor = subprocess.Popen(  # a router-like parent: its child burns CPU; a line on stdin reaps it
        [
            sys.executable,
            "-c",
            "import subprocess, sys\n"
            f"child = subprocess.Popen([sys.executable, '-c', {burn!r}])\n"
            "print(child.pid, flush=True)\nsys.stdin.readline()\nchild.kill()\nchild.wait()\n"
            "print('reaped', flush=True)\nsys.stdin.readline()\n",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    child = None
    try:
        child = int(supervisor.stdout.readline())
        deadline = time.monotonic() + 10
        while (process_cpu_s(child) or 0) < 0.25 and time.monotonic() < deadline:
            time.sleep(0.05)
        own, burned = process_cpu_s(supervisor.pid), process_cpu_s(child)
        assert burned >= 0.25
        # (clock ticks are 0.01 s: 0.02 + 0.28 is 0.30000000000000004 in floats, the tree's 0.3)
        assert process_tree_cpu_s(supervisor.pid) >= own + burned - 1e-9
        supervisor.stdin.write("\n")
        supervisor.stdin.flush()
        assert supervisor.stdout.readline() == "reaped\n" and process_cpu_s(child) is None
        assert process_tree_cpu_s(supervisor.pid) >= own + burned - 1e-9  # now in the reaped-children time
    finally:
        supervisor.kill()
        supervisor.wait()
        if child is not None and process_cpu_s(child) is not None:
            subprocess.run(["kill", "-9", str(child)], check=False)
    assert process_tree_cpu_s(2**22 + 12345) is None


def test_serve_hf_backend_in_process(cache, capsys):
    argv = [
        "bench",
        "serve",
        "--backend",
        "hf",
        "--random-weights",
        "llama/tiny",
        "--num-prompts",
        "5",
        "--input-len",
        "8",
        "--output-len",
        "4",
        "--request-rate",
        "100",
        "--max-concurrency",
        "0",
        "2",
        "--hf-batch-size",
        "3",
        "--device",
        "cpu",
        "--goodput",
        "tpot:60000",
    ]
    assert main(argv) == 0
    report = report_of(capsys)
    assert report["model"].startswith("transformers:") and report["device"] == "cpu"
    check_serve_runs(report, [(100.0, None), (100.0, 2)], 5, 4)
    for r in report["runs"]:  # one chunk per generated token: three gaps per request
        assert r["itl_ms"]["mean"] == pytest.approx(r["tpot_ms"]["mean"])


def test_ttft_breakdown_times_each_hop_of_a_local_stack(cache, capsys):
    from pdserve.bench.micro.ttft_breakdown import HOPS
    from pdserve.bench.micro.ttft_breakdown import main as ttft_main

    argv = [
        "--random-weights",
        "llama/tiny",
        "--input-len",
        "8",
        "--output-len",
        "3",
        "--requests",
        "2",
        "--warmup",
        "1",
        "--device",
        "cpu",
        "--max-total-tokens",
        "4096",
    ]
    assert ttft_main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    names = [line.split(":")[0].strip() for line in lines if "median" in line]
    assert names == ["router TTFT", "router 3 tok", *(h.strip() for h in HOPS)]
    medians = [float(line.split("median")[1].split("ms")[0]) for line in lines if "median" in line]
    assert all(m > 0 for m in medians)


def test_prefill_latency_times_one_prompt_at_a_time(cache, capsys):
    from pdserve.bench.micro.prefill_latency import main as latency_main

    argv = [
        "--random-weights",
        "llama/tiny",
        "--input-lens",
        "8",
        "5000",
        "--requests",
        "2",
        "--warmup",
        "1",
        "--device",
        "cpu",
        "--max-total-tokens",
        "8192",
    ]
    assert latency_main(argv) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (report["device"], report["path"], report["graph_replays"]) == ("cpu", "eager prefill", 0)
    context = 1024  # llama/tiny's max_position_embeddings: a longer length is cut to fit one token of output
    assert [r["input_len"] for r in report["rows"]] == [8, context - 1]
    assert all(0 < r["min_ms"] <= r["median_ms"] for r in report["rows"])


def test_multi_turn_conversations_resend_their_history_and_hit_the_prefix_cache(cache, capsys):
    """--conversations: each turn's prompt is the conversation so far (the server's own answers
    included) plus a user message, so prompts grow by user + output tokens a turn, and from the second
    turn on the prefill server's cache holds the earlier turns, and the decode server's too."""
    argv = ["bench", "serve", "--random-weights", "llama/tiny", "--device", "cpu", "--max-total-tokens", "4096"]
    argv += ["--conversations", "3", "--turns", "3", "--system-len", "32", "--user-len", "8", "--output-len", "4"]
    argv += ["--page-size", "4", "--disable-overlap-schedule"]
    assert main(argv) == 0
    report = report_of(capsys)
    assert report["multi_turn"] == {
        "conversations": 3, "turns": 3, "system_len": 32, "user_len": 8, "think_time_s": 0.0,
    }  # fmt: skip
    [run] = report["runs"]
    assert (run["completed"], run["failed"], run["total_output_tokens"]) == (9, 0, 36)
    turns = run["turns"]
    assert [(t["turn"], t["completed"], t["mean_prompt_len"]) for t in turns] == [(1, 3, 40), (2, 3, 52), (3, 3, 64)]
    assert turns[2]["mean_cached_tokens"] >= 40 and all(t["cached_share"] > 0 for t in turns[1:])
    assert all(t["ttft_ms"]["p50"] > 0 for t in turns)
    # Prefix-aware transfers: the first turn's whole prompt crosses to the decode server (10 pages of
    # 4 tokens), a later one only the pages the decode server does not hold: its cache has the previous
    # turn (prompt + the outputs but the last, whose KV no step computed: 40 + 3 tokens, 10 whole
    # pages, then 52 + 3: 13), so the 8 new user tokens and the 4 of the answer: 3 pages.
    per_page = turns[0]["mean_kv_transfer_bytes"] / 10
    assert per_page > 0 and [t["mean_kv_transfer_bytes"] / per_page for t in turns] == [10, 3, 3]
    bad = ["bench", "serve", "--random-weights", "llama/tiny", "--conversations", "2"]
    assert main([*bad, "--client-workers", "2"]) == 2 and main([*bad, "--turns", "0"]) == 2


def test_bench_transfer_moves_every_page_and_reports_per_request_costs(tmp_path, capsys):
    """The transfer micro-benchmark on DRAM pools in two processes, pages shuffled: every destination
    page equals its source, and each request's WRITE is one descriptor per (layer, K/V, page run)."""
    out = tmp_path / "transfer.json"
    argv = ["bench", "transfer", "--shape", "llama/1b", "--requests", "4", "--tokens", "40", "--page-size", "8"]
    assert main([*argv, "--fragment", "--time-calls", "--output-json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["bad_pages"] == 0
    # --time-calls: every WRITE (4 warm-up, 4 serial, 4 burst) timed, and the NIXL post inside it
    calls = report["calls"]["nixl"]
    assert calls["write_pages (the whole WRITE)"]["calls"] == calls["nixl: transfer (the post)"]["calls"] == 12
    assert calls["write_pages (the whole WRITE)"]["p50_us"] >= calls["nixl: transfer (the post)"]["p50_us"] > 0
    assert [(r["path"], r["phase"], r["requests"]) for r in report["results"]] == [
        ("nixl", "serial", 4),
        ("nixl", "burst", 4),
    ]
    layers, heads, pages = 16, 8, 5
    for r in report["results"]:
        # Shuffled pages: most of a request's 5 pages are runs of their own on both sides.
        assert 2 * layers < r["ops_per_request"] <= 2 * layers * pages
        assert r["route"] == "NIXL" and r["gb_per_s"] > 0 and r["notif_ms_p50"] > 0
        assert r["mib_per_request"] == 2 * layers * heads * 64 * 40 * 4 / 2**20
    assert "ops/req" in capsys.readouterr().out
    assert main([*argv, "--paths", "direct"]) == 2  # a device copy needs CUDA pools: refused, with why
