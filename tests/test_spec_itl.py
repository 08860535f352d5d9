"""`pdserve bench spec-itl` (bench/micro/spec_itl.py): inter-token latency and acceptance of n-gram speculation
on the copy workload against no speculation, on a tiny model on CPU — the report's structure, the
exactness check and the speculation counters; the times per token it derives. Behaviour, not speed."""

import json

import pytest

from pdserve.bench.micro import spec_itl
from pdserve.common.cli import main
from pdserve.common.types import SamplingParams

# qwen3's tiny random model repeats itself within 32 tokens: the n-gram proposer's drafts get accepted.
ARGS = ["--device", "cpu", "--num-prompts", "4", "--output-len", "32", "--batch-size", "1", "2"]


def test_the_report_compares_itl_off_and_on_with_identical_answers(tiny_models, tmp_path, capsys):
    out = tmp_path / "itl.json"
    argv = ["bench", "spec-itl", "--model-path", tiny_models("qwen3"), *ARGS, "--output-json", str(out)]
    assert main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    report = json.loads(lines[-1])
    assert json.loads(out.read_text()) == report
    assert any(line.startswith("B |") for line in lines)  # the table
    assert report["bench"] == "spec-itl" and report["speculative"] == "ngram"
    assert report["num_speculative_tokens"] == 4 and report["device"] == "cpu"
    assert report["command"].startswith("pdserve bench spec-itl")
    assert [r["batch_size"] for r in report["rows"]] == [1, 2]
    for r in report["rows"]:
        assert r["answers_differing"] == 0 and r["requests"] == 4 and r["output_tokens"] > 4
        for name in ("off", "on"):
            assert 0 < r[f"itl_median_ms_{name}"] <= r[f"itl_p90_ms_{name}"]
        assert r["itl_median_ratio"] == pytest.approx(r["itl_median_ms_off"] / r["itl_median_ms_on"])
        assert r["itl_p90_ratio"] == pytest.approx(r["itl_p90_ms_off"] / r["itl_p90_ms_on"])
        # the counters of the measured waves: drafts proposed and accepted, more than one token a step
        assert r["spec_verify_steps"] > 0 and 0 < r["spec_accepted_tokens"] <= r["spec_proposed_tokens"]
        assert r["acceptance"] == pytest.approx(r["spec_accepted_tokens"] / r["spec_proposed_tokens"])
        assert r["accepted_per_verified_request"] == pytest.approx(
            r["spec_accepted_tokens"] / r["spec_verified_requests"]
        )
        assert r["tokens_per_step_off"] == 1.0 and r["tokens_per_step_on"] > 1.0
    # the same answers at every batch size: the same tokens generated
    assert len({r["output_tokens"] for r in report["rows"]}) == 1


def test_answers_that_differ_fail_the_bench(tiny_models, monkeypatch):
    """Exactness is the contract: a speculative answer unlike the plain one raises, naming where."""
    run_engine, runs = spec_itl.run_engine, []

    def corrupted(config, *args):
        result = run_engine(config, *args)
        runs.append(config.speculative)
        if config.speculative:
            result["answers"][1] = result["answers"][1][:2] + [result["answers"][1][2] + 1]
        return result

    monkeypatch.setattr(spec_itl, "run_engine", corrupted)
    argv = ["bench", "spec-itl", "--model-path", tiny_models("qwen3"), *ARGS[:-1]]
    with pytest.raises(RuntimeError, match="prompt 1: the speculative answer differs from the plain one at token 2"):
        main(argv)
    assert runs == ["", "ngram"]


def test_each_token_gets_the_time_its_step_result_was_processed(make_engine):
    """timed_wave's stamps: a request's token count after each processing that gave it tokens — the
    prefill's first token alone, then one a plain step, more than one where drafts were accepted — ending
    at its answer's length, in time order; the engine's own method back afterwards."""
    engine = make_engine("qwen3", speculative="ngram")
    prompts = [[0] + [5, 6, 7, 8, 9] * 6, [0] + [11, 12, 13] * 8 + [40, 41]]
    waves = spec_itl.timed_wave(engine, prompts, SamplingParams(max_new_tokens=24, temperature=0))
    assert "process_batch_result" not in vars(engine)
    jumps = []
    for output_ids, stamps in waves:
        counts, times = [n for _, n in stamps], [t for t, _ in stamps]
        assert counts[0] == 1 and counts[-1] == len(output_ids) and times == sorted(times)
        assert all(b > a for a, b in zip(counts, counts[1:]))
        jumps += [b - a for a, b in zip(counts, counts[1:])]
        itl, per_step = spec_itl.itl_and_steps(stamps)
        assert itl == pytest.approx((times[-1] - times[0]) / (len(output_ids) - 1))
        assert per_step == pytest.approx((len(output_ids) - 1) / (len(stamps) - 1))
    assert max(jumps) > 1  # accepted drafts: several tokens at one time
    assert spec_itl.itl_and_steps([(1.0, 1)]) is None  # one token: no inter-token latency
