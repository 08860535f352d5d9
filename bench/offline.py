"""`pdserve bench offline`: throughput of a fixed batch, the engine and/or transformers.

Each backend runs --warmup + --repeats prompt sets (run i uses the same ids for both backends; with
both, their runs alternate) and reports the medians of the measured runs. Throughputs: output
tok/s = prompts * output_len / s, total tok/s = prompts * (input_len + output_len) / s, req/s =
prompts / s. With both, the transformers model stays loaded beside the engine: the engine's KV
cache is sized from what memory it leaves.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

from pdserve.bench.random_weights import model_path_from_args
from pdserve.bench.report import command_line, device_name, emit, table
from pdserve.bench.workload import random_prompts, token_pool
from pdserve.common.config import EngineConfig, from_cli_args

NUMBERS = ("output_tok_s", "total_tok_s", "req_s", "elapsed_s")


def run_offline(args: argparse.Namespace) -> int:
    model_path_from_args(args)
    config = from_cli_args(args, EngineConfig).resolve()
    if args.input_len + args.output_len > config.context_length:
        raise ValueError(f"--input-len + --output-len exceeds the context length {config.context_length}")
    pool = token_pool(config.model_path)
    prompt_sets = [
        random_prompts(pool, args.num_prompts, args.input_len, args.seed, run, args.prefix_groups, args.prefix_len)
        for run in range(args.warmup + args.repeats)
    ]
    timers = {}
    try:
        # transformers first: the engine sizes its KV cache from the memory left beside its model.
        if args.backend in ("hf", "both"):
            timers["hf"] = HFTimer(args, config)
        if args.backend in ("pdserve", "both"):
            timers["pdserve"] = EngineTimer(args, config)
        runs = {name: [] for name in timers}
        # Interleaved, run i of each backend back to back: a stretch when the machine is slower
        # (its host is shared) then hits both backends alike instead of skewing their ratio.
        for run, prompts in enumerate(prompt_sets):
            for name, timer in timers.items():
                runs[name].append(run_numbers(args, run, timer(prompts)))
                print_run(name, args, runs[name][-1])
    finally:
        for timer in timers.values():
            timer.close()
    report = offline_report(args, config, runs)
    print_summary(args, report)
    emit(report, args.output_json)
    return 0


class EngineTimer:
    """`timer(prompts)`: seconds for the engine to generate them all (checked afterwards)."""

    def __init__(self, args: argparse.Namespace, config) -> None:
        from pdserve.common.engine.engine import Engine
        from pdserve.common.types import SamplingParams

        self.engine = Engine(config)
        self.output_len, self.device = args.output_len, config.device
        capacity, workload = (
            self.engine.stats()["kv_total_tokens"],
            args.num_prompts * (args.input_len + args.output_len),
        )
        if capacity < workload:
            print(
                f"note: the KV cache holds {capacity} tokens, the workload {workload}: not every prompt runs at once "
                f"(--max-total-tokens, --kv-cache-memory-gb or --mem-fraction-static size it)",
                flush=True,
            )
        self.params = SamplingParams(max_new_tokens=args.output_len, temperature=args.temperature, ignore_eos=True)

    def __call__(self, prompts: list[list[int]]) -> float:
        from pdserve.bench.hf import synchronize

        synchronize(self.device)
        start = time.perf_counter()
        completions = self.engine.generate(prompts, self.params)
        synchronize(self.device)
        elapsed = time.perf_counter() - start
        check_completions(completions, self.output_len)
        return elapsed

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()  # with --tp-size N, its other ranks exit
        self.engine = None


def check_completions(completions, output_len: int) -> None:
    """A benchmark that produced fewer tokens than it counts must fail, loudly."""
    for c in completions:
        if c.error is not None or len(c.output_ids) != output_len:
            raise RuntimeError(
                f"request {c.rid} produced {len(c.output_ids)} tokens, expected {output_len} "
                f"(finish_reason {c.finish_reason.value}, error {c.error})"
            )


class HFTimer:
    """`timer(prompts)`: seconds for transformers `generate` (SDPA's cuDNN path off, see hf.py)."""

    def __init__(self, args: argparse.Namespace, config) -> None:
        from pdserve.bench.hf import load_hf_model

        self.model = load_hf_model(config.model_path, config.device, config.dtype)
        self.args, self.device = args, config.device

    def __call__(self, prompts: list[list[int]]) -> float:
        from pdserve.bench.hf import cudnn_attention_off, hf_generate_timed

        args = self.args
        with cudnn_attention_off():
            return hf_generate_timed(
                self.model, prompts, args.output_len, args.hf_batch_size, args.temperature, self.device
            )

    def close(self) -> None:
        from pdserve.bench.hf import free_hf_model

        if self.model is not None:
            model, self.model = self.model, None
            free_hf_model(model)


def run_numbers(args: argparse.Namespace, run: int, elapsed: float) -> dict:
    n = args.num_prompts
    return {
        "run": run,
        "warmup": run < args.warmup,
        "elapsed_s": elapsed,
        "output_tok_s": n * args.output_len / elapsed,
        "total_tok_s": n * (args.input_len + args.output_len) / elapsed,
        "req_s": n / elapsed,
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


def offline_report(args: argparse.Namespace, config, runs: dict[str, list[dict]]) -> dict:
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
        f"\n{report['device']} {report['dtype']}, {args.num_prompts} prompts x {args.input_len} in -> "
        f"{args.output_len} out; medians of {args.repeats} runs after {args.warmup} warm-up"
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
