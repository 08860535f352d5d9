"""`bench offline|serve --length-dist`: fixed lengths exactly as before, lognormal (chat-like)
lengths seeded, with the requested medians, clipped, and carried request by request to the engine
and through the load generator; the offline bench end to end on a tiny model. (The serving bench
end to end with lognormal lengths: tests/test_bench.py, the --client-workers run.)"""

import asyncio
import json
import math
import random
import statistics
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from pdserve.bench.loadgen import Chunk, run_schedule
from pdserve.bench.workload import CLIP, Lengths, Workloads, describe_workload, random_prompts
from pdserve.common.cli import main


def old_random_prompts(pool, num_prompts, input_len, seed, run, prefix_groups=0, prefix_len=0):
    """random_prompts as it was before --length-dist: fixed lengths must give exactly these."""
    rng = random.Random(f"{seed}:{run}")
    if prefix_groups <= 0:
        return [[rng.choice(pool) for _ in range(input_len)] for _ in range(num_prompts)]
    prefixes = [[rng.choice(pool) for _ in range(prefix_len)] for _ in range(prefix_groups)]
    return [
        rng.choice(prefixes) + [rng.choice(pool) for _ in range(input_len - prefix_len)] for _ in range(num_prompts)
    ]


def workload_args(**kw):
    args = dict(input_len=12, output_len=5, seed=7, prefix_groups=0, prefix_len=0, length_dist="fixed")
    return SimpleNamespace(**{**args, "length_sigma": 0.8, **kw})


@pytest.mark.parametrize("prefix", [(0, 0), (3, 4)])
def test_fixed_lengths_give_exactly_the_old_prompts(prefix):
    pool = list(range(5, 900))
    groups, prefix_len = prefix
    for run in (-1, 0, 2):
        old = old_random_prompts(pool, 9, 12, 7, run, groups, prefix_len)
        assert random_prompts(pool, 9, 12, 7, run, groups, prefix_len) == old
        work = Workloads(pool, workload_args(prefix_groups=groups, prefix_len=prefix_len), context=17).draw(9, run)
        assert work.prompts == old and work.output_lens == [5] * 9
        assert (work.input_tokens, work.output_tokens) == (9 * 12, 9 * 5)
    with pytest.raises(ValueError, match="exceeds the context length 16"):
        Workloads(pool, workload_args(), context=16)  # 12 + 5 > 16, as bench offline always refused


def test_lognormal_lengths_are_seeded_have_the_medians_and_respect_the_clips():
    lengths = Lengths("lognormal", 256, 64, sigma=0.8)
    inputs, outputs = lengths.draw(2000, seed=3, run=0)
    assert (inputs, outputs) == lengths.draw(2000, seed=3, run=0)
    assert lengths.draw(2000, seed=3, run=1) != (inputs, outputs) and lengths.draw(2000, seed=4, run=0)[0] != inputs
    assert statistics.median(inputs) == pytest.approx(256, rel=0.15)
    assert statistics.median(outputs) == pytest.approx(64, rel=0.15)
    assert statistics.mean(inputs) > 1.2 * statistics.median(inputs)  # right-skewed: a long tail
    assert min(inputs) >= 1 and min(outputs) >= 1
    assert max(inputs) == CLIP * 256 and max(outputs) == CLIP * 64  # the tail is cut at 4 x the median
    for sigma in (0.8, 1.5):  # the spread: quartiles at median x exp(-+0.674 sigma), inside the clips
        q1, _, q3 = statistics.quantiles(Lengths("lognormal", 256, 64, sigma).draw(2000, seed=3, run=0)[0], n=4)
        assert math.log(q3 / q1) / (2 * 0.6745) == pytest.approx(sigma, rel=0.15)

    # Clipped to the context: the prompt to context - 1, the output to what is left.
    fitted = Lengths("lognormal", 256, 64, sigma=0.8, context=400)
    f_inputs, f_outputs = fitted.draw(2000, seed=3, run=0)
    assert max(p + o for p, o in zip(f_inputs, f_outputs)) == 400 and max(f_inputs) == 399
    assert sum(p + o > 400 for p, o in zip(inputs, outputs)) > 20  # without the context, some would not fit
    assert [(p, o) for p, o in zip(inputs, outputs) if p + o <= 400] == [
        (p, o) for p, o, q, r in zip(f_inputs, f_outputs, inputs, outputs) if q + r <= 400
    ]  # the ones that fit are untouched
    # A prompt holds its shared prefix and one id more.
    assert min(Lengths("lognormal", 20, 4, sigma=2.0, min_input=17).draw(500, 1, 0)[0]) == 17


def test_lognormal_workloads_carry_each_requests_lengths_and_report_them():
    pool = list(range(100))
    args = workload_args(length_dist="lognormal", length_sigma=1.0, prefix_groups=2, prefix_len=6)
    workloads = Workloads(pool, args, context=60)
    warmup = workloads.draw(4, run=-1, record=False, prefixes=False)
    works = [workloads.draw(50, run) for run in (0, 1)]
    for run, work in enumerate(works):
        inputs, outputs = Lengths("lognormal", 12, 5, 1.0, min_input=7, context=60).draw(50, 7, run)
        assert [len(p) for p in work.prompts] == inputs and work.output_lens == outputs
        assert len({tuple(p[:6]) for p in work.prompts}) == 2  # the shared prefixes
    assert len({tuple(p[:6]) for p in warmup.prompts}) == 4  # the warm-up shares none
    drawn = [(len(p), o) for w in works for p, o in zip(w.prompts, w.output_lens)]
    report = workloads.report()
    assert report["mean_input_len"] == pytest.approx(sum(i for i, _ in drawn) / 100)
    assert report["mean_output_len"] == pytest.approx(sum(o for _, o in drawn) / 100)
    assert (report["dist"], report["sigma"], report["context"]) == ("lognormal", 1.0, 60)
    assert report["max_input_len"] == max(i for i, _ in drawn) and report["max_output_len"] <= 4 * 5
    text = describe_workload(100, "requests", report)
    assert text.startswith("100 requests, lognormal lengths, medians 12 -> 5, sigma 1; mean ")
    assert describe_workload(8, "prompts", Workloads(pool, workload_args()).report()) == "8 prompts x 12 in -> 5 out"


def test_lognormal_draws_are_the_same_in_another_process():
    code = (
        "from pdserve.bench.workload import Lengths; print(Lengths('lognormal', 100, 30, 0.8).draw(50, seed=11, run=2))"
    )
    other = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env={"PYTHONHASHSEED": "123"}
    )
    assert other.stdout.strip() == str(Lengths("lognormal", 100, 30, 0.8).draw(50, seed=11, run=2))


class LengthBackend:
    """Streams as many token chunks as each request asks for, and records what was asked."""

    def __init__(self):
        self.asked = []

    async def stream(self, prompt, output_len):
        self.asked.append((len(prompt), output_len))
        for _ in range(output_len):
            await asyncio.sleep(0)
            yield Chunk(time.perf_counter(), tokens=True)
        yield Chunk(time.perf_counter(), tokens=False, usage_tokens=output_len)


def test_the_load_generator_sends_each_request_its_own_output_length():
    backend = LengthBackend()
    prompts, lens = [[1] * n for n in range(1, 6)], [3, 1, 4, 1, 5]
    results, _ = asyncio.run(run_schedule(backend, prompts, lens, math.inf, 2, seed=0, timeout_s=5))
    assert sorted(backend.asked) == list(zip(range(1, 6), lens))
    assert [(r.prompt_len, r.output_tokens, r.success) for r in results] == [
        (n, o, True) for n, o in zip(range(1, 6), lens)
    ]
    with pytest.raises(ValueError, match="5 prompts but 4 output lengths"):
        asyncio.run(run_schedule(backend, prompts, lens[:4], math.inf, 0, seed=0, timeout_s=5))


def test_length_flags_are_checked(capsys):
    base = ["bench", "offline", "--random-weights", "qwen3/tiny", "--device", "cpu"]
    assert main([*base, "--length-dist", "lognormal", "--length-sigma", "0"]) == 2
    assert "--length-sigma must be > 0" in capsys.readouterr().err
    assert main([*base, "--length-dist", "lognormal", "--backend", "both"]) == 2
    assert "--backend pdserve" in capsys.readouterr().err
    serve = ["bench", "serve", "--base-url", "http://127.0.0.1:9", "--vocab-size", "100", "--length-dist", "lognormal"]
    assert main([*serve, "--conversations", "2"]) == 2
    assert "no --conversations" in capsys.readouterr().err


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "pdserve-cache"))


def test_offline_lognormal_counts_the_tokens_each_request_generated(cache, capsys):
    # --context-length 24 against medians 8 -> 4 (clipped at 32 and 16): some draws are cut to fit.
    argv = ["bench", "offline", "--random-weights", "qwen3/tiny", "--device", "cpu", "--disable-overlap-schedule"]
    argv += ["--num-prompts", "6", "--input-len", "8", "--output-len", "4", "--seed", "3", "--context-length", "24"]
    argv += ["--length-dist", "lognormal", "--length-sigma", "1.0", "--warmup", "0", "--repeats", "2"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    report = json.loads(out.strip().splitlines()[-1])
    draws = [Lengths("lognormal", 8, 4, 1.0, context=24).draw(6, seed=3, run=run) for run in (0, 1)]
    unclipped = [Lengths("lognormal", 8, 4, 1.0).draw(6, seed=3, run=run) for run in (0, 1)]
    assert any(p + o > 24 for ins, outs in unclipped for p, o in zip(ins, outs))  # the context clip mattered
    assert any(sum(outs) != 6 * 4 for _, outs in draws)  # not what prompts x --output-len would count
    runs = report["backends"]["pdserve"]["runs"]
    for r, (ins, outs) in zip(runs, draws, strict=True):
        assert (r["input_tokens"], r["output_tokens"]) == (sum(ins), sum(outs))
        assert r["output_tok_s"] == pytest.approx(sum(outs) / r["elapsed_s"])
        assert r["total_tok_s"] == pytest.approx((sum(ins) + sum(outs)) / r["elapsed_s"])
    lengths = report["lengths"]
    assert (lengths["dist"], lengths["sigma"], lengths["context"]) == ("lognormal", 1.0, 24)
    assert lengths["mean_output_len"] == pytest.approx(sum(sum(outs) for _, outs in draws) / 12)
    assert lengths["max_input_len"] + 1 <= 24
    assert "6 prompts, lognormal lengths, medians 8 -> 4, sigma 1; mean " in out
