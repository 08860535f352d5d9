"""`pdserve bench serve`: online serving latency and throughput (see SERVE_DOC in bench/cli.py).

One run per (--request-rate, --max-concurrency) pair, one after another on the same server, each
with a fresh prompt set (a repeated one would hit the prefix cache); --warmup requests go first,
one at a time, unmeasured, and must succeed. With --client-workers N > 1 the measured requests
are sent from N processes (client_workers.py); the warm-up stays in this one.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import math
from contextlib import ExitStack, nullcontext

from pdserve.bench.client_workers import ClientWorkers
from pdserve.bench.http_client import get_json
from pdserve.bench.loadgen import OpenAIBackend, run_schedule, timed_request
from pdserve.bench.metrics import parse_goodput, summarize
from pdserve.bench.multi_turn import check_multi_turn, multi_turn_report, multi_turn_run, print_turns
from pdserve.bench.proc_cpu import cpu_per_1k_tokens, process_cpu_s, process_tree_cpu_s
from pdserve.bench.random_weights import model_path_from_args
from pdserve.bench.report import command_line, device_name, emit, table
from pdserve.bench.sweep import StackSpec, goodput_rate, parse_stack, plot_sweep
from pdserve.bench.workload import Workload, Workloads, describe_workload, token_pool
from pdserve.common.config import EngineConfig, from_cli_args
from pdserve.common.gc_tuning import tune_gc

LATENCIES = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2el_ms", "E2E"))


def run_serve(args: argparse.Namespace) -> int:
    slos = parse_goodput(args.goodput)
    model_path = model_path_from_args(args, required=False)
    if args.backend == "hf" and (args.base_url or not model_path):
        raise ValueError(
            "--backend hf runs transformers in-process: give --model-path or --random-weights, no --base-url"
        )
    if not args.base_url and not model_path:
        raise ValueError("give --base-url, or --model-path / --random-weights to start a local stack")
    if not args.vocab_size and not model_path:
        raise ValueError("prompt ids need a vocabulary: give --vocab-size, --model-path or --random-weights")
    if args.num_prefill < (0 if args.disagg_policy == "never" else 1):
        raise ValueError("--num-prefill must be >= 1 (0 with --disagg-policy never)")
    stacks = [parse_stack(spec) for spec in args.stacks]
    if stacks and (args.base_url or args.backend == "hf"):
        raise ValueError("--stacks starts local stacks: no --base-url, no --backend hf")
    if args.plot and not stacks:
        raise ValueError("--plot draws the --stacks sweep: give --stacks")
    if not 0 < args.attainment <= 1:
        raise ValueError("--attainment must be in (0, 1]")
    if (args.base_url or args.backend == "hf") and (
        args.num_prefill != 1
        or args.prefill_policy != "round_robin"
        or args.num_decode != 1
        or args.prefill_tp
        or args.decode_tp
        or args.gpus is not None
    ):
        raise ValueError(
            "--num-prefill, --num-decode, --prefill-tp, --decode-tp, --gpus and --prefill-policy shape "
            "the local stack; a --base-url server or --backend hf has none"
        )
    if any(not rate > 0 for rate in args.request_rate) or any(c < 0 for c in args.max_concurrency):
        raise ValueError("--request-rate must be > 0 (inf: all at once), --max-concurrency >= 0 (0: no limit)")
    check_client_args(args)
    check_multi_turn(args)
    pool = list(range(args.vocab_size)) if args.vocab_size else token_pool(model_path)
    config = from_cli_args(args, EngineConfig)
    local = config.resolve() if not args.base_url else None  # the device and dtype this machine serves with
    work = Workloads(pool, args, local.context_length if local else None)  # a --base-url server's: unknown
    router_pid = args.router_pid  # the router whose CPU time (with its children's) each run reports
    if stacks:
        return run_stacks(args, stacks, config, local, work, slos)
    with ExitStack() as cleanup:
        if args.backend == "hf":
            backend, model = hf_backend(args, local, cleanup), f"transformers:{model_path}"
        else:
            base_url = args.base_url
            if base_url is None:
                from pdserve.bench.stack import local_stack, sm_shares_of

                max_inflight = max(1024, args.num_prompts)  # the router must not turn our own load away (429)
                stack = cleanup.enter_context(
                    local_stack(
                        config,
                        local.device,
                        max_inflight,
                        args.num_prefill,
                        args.prefill_policy,
                        args.server_torch_threads,
                        num_decode=args.num_decode,
                        prefill_tp=args.prefill_tp,
                        decode_tp=args.decode_tp,
                        gpus=args.gpus,
                        disagg_policy=args.disagg_policy,
                        mps=args.mps,
                        sm_shares=sm_shares_of(args),
                        router_workers=args.router_workers,
                        decode_max_total_tokens=args.decode_max_total_tokens,
                    )
                )
                base_url, router_pid = stack.base_url, stack.router_pid
            headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
            model = args.model or asyncio.run(get_json(base_url + "/v1/models", headers))["data"][0]["id"]
            backend = OpenAIBackend(base_url, model, args.api_key)
        tune_gc()  # the client's own start-up heap (tokenizer, prompts) stays out of its collections
        runs = asyncio.run(bench_runs(backend, args, work, slos, router_pid))
    report = {
        "bench": "serve",
        "command": command_line(args.argv),
        "backend": args.backend,
        "base_url": args.base_url,  # None: a local stack (pdserve) or in-process (hf)
        "device": device_name(local.device) if local else None,
        "dtype": local.dtype if local else None,
        "model": model,
        "model_path": model_path or None,
        "random_weights": args.random_weights,
        "num_prompts": args.num_prompts,
        "client_workers": args.client_workers,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "lengths": work.report(),  # --length-dist, its medians and sigma, the mean and most drawn
        "num_prefill": args.num_prefill if not args.base_url else None,
        "prefill_policy": args.prefill_policy if not args.base_url else None,
        "prefix_groups": args.prefix_groups,
        "prefix_len": args.prefix_len,
        "multi_turn": multi_turn_report(args),
        "goodput_slos_ms": slos,
        "runs": runs,
    }
    print_summary(report)
    emit(report, args.output_json)
    return 1 if any(run["failed"] for run in runs) else 0


def run_stacks(args: argparse.Namespace, stacks: list[StackSpec], config, local, work: Workloads, slos: dict) -> int:
    """Every --request-rate on each local stack in turn (bench/sweep.py): one report, a plot."""
    from pdserve.bench.stack import local_stack, sm_shares_of

    results = []
    for spec in stacks:
        print(
            f"\n######## stack {spec.name}: {spec.num_prefill} prefill, {spec.num_decode} decode, "
            f"--disagg-policy {spec.disagg_policy}, SM shares {spec.sm_shares or sm_shares_of(args)} ########",
            flush=True,
        )
        with local_stack(
            config,
            local.device,
            max(1024, args.num_prompts),
            spec.num_prefill,
            args.prefill_policy,
            args.server_torch_threads,
            num_decode=spec.num_decode,
            prefill_tp=args.prefill_tp,
            decode_tp=args.decode_tp,
            gpus=args.gpus,
            disagg_policy=spec.disagg_policy,
            mps=args.mps,
            sm_shares=spec.sm_shares or sm_shares_of(args),
            router_workers=args.router_workers,
            decode_max_total_tokens=args.decode_max_total_tokens,
        ) as stack:
            headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
            model = args.model or asyncio.run(get_json(stack.base_url + "/v1/models", headers))["data"][0]["id"]
            tune_gc()
            runs = asyncio.run(
                bench_runs(OpenAIBackend(stack.base_url, model, args.api_key), args, work, slos, stack.router_pid)
            )
        results.append(
            {
                "name": spec.name,
                "num_prefill": spec.num_prefill,
                "num_decode": spec.num_decode,
                "disagg_policy": spec.disagg_policy,
                "sm_shares": str(spec.sm_shares or sm_shares_of(args)),
                "goodput_rate": goodput_rate(runs, args.attainment),
                "runs": runs,
            }
        )
    report = {
        "bench": "serve",
        "command": command_line(args.argv),
        "device": device_name(local.device),
        "dtype": local.dtype,
        "model_path": config.model_path,
        "random_weights": args.random_weights,
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "lengths": work.report(),
        "prefix_groups": args.prefix_groups,
        "prefix_len": args.prefix_len,
        "goodput_slos_ms": slos,
        "attainment": args.attainment,
        "stacks": results,
    }
    header = ["stack", "rate", "ok", "failed", "SLO attainment", "out tok/s", "TTFT p90", "TPOT p90"]
    rows = [
        [
            r["name"],
            run["request_rate"],
            run["completed"],
            run["failed"],
            "-" if run["slo_attainment"] is None else f"{run['slo_attainment']:.0%}",
            f"{run['output_throughput']:.1f}",
            f"{run['ttft_ms']['p90']:.1f}",
            f"{run['tpot_ms']['p90']:.2f}",
        ]
        for r in results
        for run in r["runs"]
    ]
    print("\n" + table(header, rows) + "\n  (latencies in ms)", flush=True)
    for r in results:
        print(
            f"goodput of {r['name']}: "
            + (
                "no rate meets the SLOs"
                if r["goodput_rate"] is None
                else f"{r['goodput_rate']:g} req/s (SLO attainment >= {args.attainment:.0%})"
            )
        )
    if args.plot:
        slo_text = ", ".join(f"{k} {v:g} ms" for k, v in slos.items()) or "no SLOs"
        workload = describe_workload(args.num_prompts, "requests", report["lengths"])
        plot_sweep(
            {r["name"]: r["runs"] for r in results},
            {r["name"]: r["goodput_rate"] for r in results},
            args.attainment,
            f"{report['device']}: {workload}; SLOs {slo_text}",
            args.plot,
        )
        print(f"plot: {args.plot}")
    emit(report, args.output_json)
    return 1 if any(run["failed"] for r in results for run in r["runs"]) else 0


def hf_backend(args: argparse.Namespace, config, cleanup: ExitStack):
    from pdserve.bench.hf import cudnn_attention_off, load_hf_model
    from pdserve.bench.hf_serve import HFServer

    model = load_hf_model(config.model_path, config.device, config.dtype)
    cleanup.enter_context(cudnn_attention_off())
    server = HFServer(model, config.device, args.output_len, args.hf_batch_size)
    cleanup.callback(server.close)
    return server


def check_client_args(args: argparse.Namespace) -> None:
    if args.client_workers < 1:
        raise ValueError("--client-workers must be >= 1")
    if args.client_workers > 1 and args.backend == "hf":
        raise ValueError("--client-workers > 1 sends over HTTP; --backend hf serves in this process")
    if args.router_pid is not None:
        if not args.base_url:
            raise ValueError("--router-pid is for a --base-url server's router; a local stack's is measured anyway")
        if args.router_pid < 1 or process_cpu_s(args.router_pid) is None:
            raise ValueError(f"--router-pid {args.router_pid}: no such process on this host")


async def bench_runs(
    backend, args: argparse.Namespace, work: Workloads, slos: dict, router_pid: int | None = None
) -> list[dict]:
    warmup = work.draw(args.warmup, run=-1, record=False, prefixes=False)
    for prompt, output_len in zip(warmup.prompts, warmup.output_lens):
        result = await timed_request(backend, prompt, output_len, args.request_timeout)
        if not result.success:
            raise RuntimeError(f"warm-up request failed: {result.error}")
    runs = []
    if args.conversations:
        for rate, concurrency in itertools.product(args.request_rate, args.max_concurrency):
            runs.append(await multi_turn_run(backend, args, work.pool, rate, concurrency, slos, router_pid))
            print_run(runs[-1])
            print_turns(runs[-1]["turns"])
        return runs
    with ClientWorkers(args.client_workers, backend) if args.client_workers > 1 else nullcontext() as workers:
        for index, (rate, concurrency) in enumerate(itertools.product(args.request_rate, args.max_concurrency)):
            requests = work.draw(args.num_prompts, index)  # the same for every stack of --stacks
            limit = concurrency or "none"
            print(f"measuring: rate {rate} req/s, max concurrency {limit}, {args.num_prompts} requests", flush=True)
            run = await measured_run(backend, workers, requests, args, rate, concurrency, slos, router_pid)
            print_run(run)
            runs.append(run)
    return runs


async def measured_run(
    backend,
    workers: ClientWorkers | None,
    requests: Workload,
    args: argparse.Namespace,
    rate: float,
    concurrency: int,
    slos: dict,
    router_pid: int | None,
) -> dict:
    """One run, sent from this process or dealt across the client workers: its summary, and the
    CPU the client and the router spent per 1,000 streamed tokens (the client: this process, which
    also runs an --backend hf model, plus its workers; the router: with its child processes)."""
    client, router = process_cpu_s(None), process_tree_cpu_s(router_pid) if router_pid else None
    if workers is None:
        results, duration = await run_schedule(
            backend, requests.prompts, requests.output_lens, rate, concurrency, args.seed, args.request_timeout
        )
        workers_cpu_s = 0.0
    else:
        results, duration, workers_cpu_s = await asyncio.to_thread(
            workers.run, requests.prompts, requests.output_lens, rate, concurrency, args.seed, args.request_timeout
        )
    run = {
        "request_rate": "inf" if math.isinf(rate) else rate,
        "max_concurrency": concurrency or None,
        **summarize(results, duration, slos),
    }
    tokens = run["total_output_tokens"]
    run["client_cpu_s_per_1k_tokens"] = cpu_per_1k_tokens(client, process_cpu_s(None) + workers_cpu_s, tokens)
    run["router_cpu_s_per_1k_tokens"] = (
        cpu_per_1k_tokens(router, process_tree_cpu_s(router_pid), tokens) if router_pid else None
    )
    run["errors"] = sorted({r.error for r in results if not r.success})[:5]
    return run


def print_run(run: dict) -> None:
    lines = [
        f"==== rate {run['request_rate']} req/s, max concurrency {run['max_concurrency'] or 'none'} ====",
        f"successful requests: {run['completed']}   failed: {run['failed']}",
        f"duration: {run['duration_s']:.3f} s   input tokens: {run['total_input_tokens']}   "
        f"output tokens: {run['total_output_tokens']}",
        f"request throughput: {run['request_throughput']:.2f} req/s   output: {run['output_throughput']:.1f} tok/s   "
        f"total: {run['total_token_throughput']:.1f} tok/s",
    ]
    if run["total_cached_tokens"] is not None:
        lines.append(
            f"prompt tokens from the prefix cache: {run['total_cached_tokens']} "
            f"({run['prefix_cache_hit_rate']:.1%} of the input)"
        )
    if run["request_goodput"] is not None:
        lines.append(f"request goodput: {run['request_goodput']:.2f} req/s")
    for key, name in LATENCIES:
        s = run[key]
        lines.append(f"{name:>4} ms: mean {s['mean']:.2f}  p50 {s['p50']:.2f}  p90 {s['p90']:.2f}  p99 {s['p99']:.2f}")
    cpu = [
        f"{who} {run[f'{who}_cpu_s_per_1k_tokens']:.3f}"
        for who in ("client", "router")
        if run[f"{who}_cpu_s_per_1k_tokens"] is not None
    ]
    if cpu:
        lines.append("CPU seconds per 1,000 output tokens: " + ", ".join(cpu))
    for error in run["errors"]:
        lines.append(f"error: {error}")
    print("\n".join(lines), flush=True)


def print_summary(report: dict) -> None:
    workload = describe_workload(report["num_prompts"], "requests", report["lengths"])
    if (turns := report["multi_turn"]) is not None:
        workload = (
            f"{turns['conversations']} conversations x {turns['turns']} turns (system {turns['system_len']}, "
            f"user {turns['user_len']} a turn) -> {report['output_len']} out"
        )
    print(f"\n{report['backend']} {report['model']} on {report['device'] or report['base_url']}, {workload}")
    header = [
        "rate",
        "max conc",
        "ok",
        "failed",
        "req/s",
        "out tok/s",
        "TTFT p50",
        "TTFT p99",
        "TPOT p50",
        "ITL p50",
        "E2E p50",
        "goodput",
    ]
    rows = []
    for run in report["runs"]:
        goodput = run["request_goodput"]
        rows.append(
            [
                run["request_rate"],
                run["max_concurrency"] or "-",
                run["completed"],
                run["failed"],
                f"{run['request_throughput']:.2f}",
                f"{run['output_throughput']:.1f}",
                f"{run['ttft_ms']['p50']:.1f}",
                f"{run['ttft_ms']['p99']:.1f}",
                f"{run['tpot_ms']['p50']:.2f}",
                f"{run['itl_ms']['p50']:.2f}",
                f"{run['e2el_ms']['p50']:.1f}",
                "-" if goodput is None else f"{goodput:.2f}",
            ]
        )
    print(table(header, rows) + "\n  (latencies in ms)\n", flush=True)
