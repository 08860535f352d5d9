"""`bench serve --stacks`: the stack specs, SLO attainment and goodput (the highest rate whose
attainment reaches the target), and the plot (bench/sweep.py). The local stacks themselves are the
ones tests/test_bench.py starts."""

import pytest

from pdserve.bench.metrics import RequestResult, summarize
from pdserve.bench.sweep import StackSpec, goodput_rate, parse_stack, plot_sweep


def test_stack_specs_parse_or_say_what_is_wrong():
    assert parse_stack("1p1d=1:1:always") == StackSpec("1p1d", 1, 1, "always")
    assert parse_stack("replicas=0:2:never") == StackSpec("replicas", 0, 2, "never")
    for bad, problem in [
        ("1:1:always", "NAME=PREFILL:DECODE:POLICY"),
        ("x=1:1", "NAME=PREFILL:DECODE:POLICY"),
        ("x=1:1:sometimes", "always, never or auto"),
        ("x=0:1:auto", "a prefill server unless"),
        ("x=1:0:always", "needs a decode server"),
    ]:
        with pytest.raises(ValueError, match=problem):
            parse_stack(bad)


def result(ttft: float, tpot: float, ok: bool = True) -> RequestResult:
    return RequestResult(
        success=ok,
        prompt_len=10,
        output_tokens=5 if ok else 0,
        ttft=ttft,
        e2e=ttft + 4 * tpot,
        itl=[tpot] * 4,
        error="" if ok else "boom",
    )


def test_slo_attainment_counts_failed_requests_as_missing_the_slos():
    results = [result(0.1, 0.01), result(0.3, 0.01), result(0.1, 0.05), result(0.1, 0.01, ok=False)]
    summary = summarize(results, 2.0, {"ttft": 200, "tpot": 20})
    assert summary["slo_attainment"] == 0.25 and summary["request_goodput"] == 0.5
    assert summarize(results, 2.0, {})["slo_attainment"] is None


def test_goodput_is_the_highest_rate_meeting_the_attainment():
    runs = [
        {"request_rate": 1.0, "slo_attainment": 1.0},
        {"request_rate": 2.0, "slo_attainment": 0.95},
        {"request_rate": 4.0, "slo_attainment": 0.7},
        {"request_rate": 3.0, "slo_attainment": 0.91},
    ]
    assert goodput_rate(runs, 0.9) == 3.0
    assert goodput_rate(runs, 0.99) == 1.0
    assert goodput_rate([{"request_rate": 1.0, "slo_attainment": 0.5}], 0.9) is None
    assert goodput_rate([{"request_rate": 1.0, "slo_attainment": None}], 0.9) is None


def test_the_plot_is_a_png_with_a_line_per_stack(tmp_path):
    def run(rate, attainment, ttft):
        return {"request_rate": rate, "slo_attainment": attainment, "ttft_ms": {"p90": ttft}, "tpot_ms": {"p90": 20.0}}

    stacks = {
        "1p1d": [run(1.0, 1.0, 50.0), run(2.0, 0.8, 400.0), run("inf", 0.1, 900.0)],
        "replicas": [run(1.0, 0.95, 80.0), run(2.0, 0.5, 700.0)],
    }
    path = tmp_path / "sweep.png"
    plot_sweep(stacks, {"1p1d": 1.0, "replicas": None}, 0.9, "test", str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_serve_sweeps_two_stacks_in_one_command(tmp_path, monkeypatch, capsys):
    """Decode servers alone (never, no prefill server) and a 1P1D pair, the same rates on each."""
    import json

    from pdserve.common.cli import main

    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "cache"))
    plot = tmp_path / "sweep.png"
    argv = [
        "bench",
        "serve",
        "--random-weights",
        "llama/tiny",
        "--num-prompts",
        "4",
        "--input-len",
        "20",
        "--output-len",
        "4",
        "--request-rate",
        "50",
        "inf",
        "--device",
        "cpu",
        "--max-total-tokens",
        "4096",
        "--goodput",
        "ttft:60000",
        "tpot:60000",
        "--stacks",
        "replicas=0:1:never",
        "1p1d=1:1:always",
        "--plot",
        str(plot),
    ]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [(s["name"], s["num_prefill"], s["disagg_policy"]) for s in report["stacks"]] == [
        ("replicas", 0, "never"),
        ("1p1d", 1, "always"),
    ]
    for stack in report["stacks"]:
        assert [run["request_rate"] for run in stack["runs"]] == [50.0, "inf"]
        assert all(run["completed"] == 4 and run["slo_attainment"] == 1.0 for run in stack["runs"])
        assert stack["goodput_rate"] == 50.0  # (inf is no rate to sustain)
    assert plot.read_bytes()[:4] == b"\x89PNG"
