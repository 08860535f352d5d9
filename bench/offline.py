"""`pdserve bench offline`: throughput of a fixed batch, the engine and/or transformers.

Each backend runs --warmup + --repeats prompt sets (run i uses the same ids for both backends; with
both, their runs alternate) and reports the medians of the measured runs. Throughputs: output
tok/s = the run's output tokens / s (prompts * output_len with --length-dist fixed, the sum of the
drawn lengths with lognormal), total tok/s = (prompt + output tokens) / s, req/s = prompts / s.
With both, the transformers model stays loaded beside the engine: the engine's KV cache is sized
from what memory it leaves.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import time

from pdserve.bench.random_weights import model_path_from_args
from pdserve.bench.report import command_line, device_name, emit, table
from pdserve.bench.workload import Workload, Workloads, describe_workload, token_pool
from pdserve.common.config import EngineConfig, from_cli_args

NUMBERS = ("output_tok_s", "total_tok_s", "req_s", "elapsed_s")


def run_offline(args: argparse.Namespace) -> int:
    model_path_from_args(args)
    config = from_cli_args(args, EngineConfig).resolve()
    workloads = Workloads(token_pool(config.model_path), args, config.context_length)  # checks the context
    prompt_sets = [
        workloads.draw(args.num_prompts, run, record=run >= args.warmup) for run in range(args.warmup + args.repeats)
    ]
    timers = {}
    try:
        # transformers first: the engine sizes its KV cache from the memory left beside its model.
        if args.backend in ("hf", "both"):
            timers["hf"] = HFTimer(args, config)
        if args.backend in ("pdserve", "both"):
            timers["pdserve"] = EngineTimer(args, config, max(w.input_tokens + w.output_tokens for w in prompt_sets))
        runs = {name: [] for name in timers}
        # Interleaved, run i of each backend back to back: a stretch when the machine is slower
        # (its host is shared) then hits both backends alike instead of skewing their ratio.
        for run, work in enumerate(prompt_sets):
            for name, timer in timers.items():
                runs[name].append(run_numbers(args, run, work, timer(work)))
                print_run(name, args, runs[name][-1])
    finally:
        for timer in timers.values():
            timer.close()
    report = offline_report(args, config, runs, workloads.report())
    if "pdserve" in timers:
        report["kv_total_tokens"] = timers["pdserve"].kv_total_tokens
    print_summary(args, report)
    emit(report, args.output_json)
    return 0


class EngineTimer:
    """`timer(workload)`: seconds for the engine to generate its prompts (checked afterwards).
    workload_tokens: the most prompt + output tokens of a run."""

    def __init__(self, args: argparse.Namespace, config, workload_tokens: int) -> None:
        from pdserve.common.engine.engine import Engine
        from pdserve.common.types import SamplingParams

        self.engine = Engine(config)
        self.device = config.device
        capacity, workload = self.engine.stats()["kv_total_tokens"], workload_tokens
        self.kv_total_tokens = capacity
        print(f"KV cache: {capacity} tokens ({config.kv_cache_dtype})", flush=True)
        if capacity < workload:
            print(
                f"note: the KV cache holds {capacity} tokens, the workload {workload}: not every prompt runs at once "
                f"(--max-total-tokens, --kv-cache-memory-gb or --mem-fraction-static size it)",
                flush=True,
            )
        # ignore_eos: each request generates exactly its max_new_tokens
        self.params = functools.partial(SamplingParams, temperature=args.temperature, ignore_eos=True)

    def __call__(self, work: Workload) -> float:
        from pdserve.bench.hf import synchronize

        params = [self.params(max_new_tokens=n) for n in work.output_lens]
        synchronize(self.device)
        start = time.perf_counter()
        completions = self.engine.generate(work.prompts, params)
        synchronize(self.device)
        elapsed = time.perf_counter() - start
        check_completions(completions, work.output_lens)
        return elapsed

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()  # with --tp-size N, its other ranks exit
        self.engine = None


def check_completions(completions, output_len: int | list[int]) -> None:
    """A benchmark that produced fewer tokens than it counts must fail, loudly. output_len: every
    request's, or each request's (a list parallel to the completions)."""
    output_lens = [output_len] * len(completions) if isinstance(output_len, int) else output_len
    for c, output_len in zip(completions, output_lens, strict=True):
        if c.error is not None or len(c.output_ids) != output_len:
            raise RuntimeError(
                f"request {c.rid} produced {len(c.output_ids)} tokens, expected {output_len} "
                f"(finish_reason {c.finish_reason.value}, error {c.error})"
            )


class HFTimer:
    """`timer(workload)`: seconds for transformers `generate` (SDPA's cuDNN path off, see hf.py);
    one output length for all (--length-dist fixed: the CLI refuses lognormal with transformers)."""

    def __init__(self, args: argparse.Namespace, config) -> None:
        from pdserve.bench.hf import load_hf_model

        self.model = load_hf_model(config.model_path, config.device, config.dtype)
        self.args, self.device = args, config.device

    def __call__(self, work: Workload) -> float:
        from pdserve.bench.hf import cudnn_attention_off, hf_generate_timed

        args = self.args
        if set(work.output_lens) != {args.output_len}:
            raise ValueError("transformers generate takes one output length per batch: use --length-dist fixed")
        with cudnn_attention_off():
            return hf_generate_timed(
                self.model, work.prompts, args.output_len, args.hf_batch_size, args.temperature, self.device
            )

    def close(self) -> None:
        from pdserve.bench.hf import free_hf_model

        if self.model is not None:
            model, self.model = self.model, None
            free_hf_model(model)


def run_numbers(args: argparse.Namespace, run: int, work: Workload, elapsed: float) -> dict:
    """A run's throughputs from the tokens it really asked for (each prompt's and output's length)."""
    input_tokens, output_tokens = work.input_tokens, work.output_tokens
    return {
        "run": run,
        "warmup": run < args.warmup,
        "elapsed_s": elapsed,
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "output_tok_s": output_tokens / elapsed,
        "total_tok_s": (input_tokens + output_tokens) / elapsed,
        "req_s": len(work.prompts) / elapsed,
    }


def print_run(backend: str, args: argparse.Namespace, r: dict) -> None:
    if r["warmup"]:
        label = f"warmup {r['run'] + 1}/{args.warmup}"
    else:
        label = f"run {r['run'] - args.warmup + 1}/{args.repeats}"
    print(
        f"{backend} {label}: {r['elapsed_s']:.3f} s, output {r['output_tok_s']:.1f} tok/s, "
        f"total {r['total_tok_s']:.1f} tok/s, {r['req_s']:.2f} req/s",
        flush=True,
    )


def medians(runs: list[dict]) -> dict:
    measured = [r for r in runs if not r["warmup"]]
    return {key: statistics.median(r[key] for r in measured) for key in NUMBERS}


def offline_report(args: argparse.Namespace, config, runs: dict[str, list[dict]], lengths: dict) -> dict:
    report = {
        "bench": "offline",
        "command": command_line(args.argv),
        "device": device_name(config.device),
        "dtype": config.dtype,
        "model_path": config.model_path,
        "random_weights": args.random_weights,
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "prefix_groups": args.prefix_groups,
        "prefix_len": args.prefix_len,
        "output_len": args.output_len,
        "lengths": lengths,  # --length-dist, its medians and sigma, the mean and most drawn
        "temperature": args.temperature,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "hf_batch_size": args.hf_batch_size,
        "engine_config": dataclasses.asdict(config),
        "backends": {name: {"median": medians(r), "runs": r} for name, r in runs.items()},
        "pdserve_over_hf_output_tok_s": None,
        "pdserve_over_hf_paired_median": None,
    }
    if "pdserve" in runs and "hf" in runs:
        backends = report["backends"]
        report["pdserve_over_hf_output_tok_s"] = (
            backends["pdserve"]["median"]["output_tok_s"] / backends["hf"]["median"]["output_tok_s"]
        )
        # Run i of each backend ran back to back on the same prompts: the median of their ratios
        # leans less on a slow stretch that hit one backend's median run more than the other's.
        paired = [p["output_tok_s"] / h["output_tok_s"] for p, h in zip(runs["pdserve"], runs["hf"]) if not p["warmup"]]
        report["pdserve_over_hf_paired_median"] = statistics.median(paired)
    return report


def print_summary(args: argparse.Namespace, report: dict) -> None:
    print(
        f"\n{report['device']} {report['dtype']}, {describe_workload(args.num_prompts, 'prompts', report['lengths'])}"
        f"; medians of {args.repeats} runs after {args.warmup} warm-up"
    )
    rows = []
    for name, backend in report["backends"].items():
        m = backend["median"]
        rows.append(
            [name, f"{m['output_tok_s']:.1f}", f"{m['total_tok_s']:.1f}", f"{m['req_s']:.2f}", f"{m['elapsed_s']:.3f}"]
        )
    print(table(["backend", "output tok/s", "total tok/s", "req/s", "s/run"], rows))
    if report["pdserve_over_hf_output_tok_s"] is not None:
        print(
            f"pdserve/hf output tok/s: {report['pdserve_over_hf_output_tok_s']:.2f}x "
            f"(median of the per-run ratios: {report['pdserve_over_hf_paired_median']:.2f}x)"
        )
    print(flush=True)
