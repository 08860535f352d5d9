"""`pdserve bench spec-itl`: the inter-token latency and acceptance of speculative decoding (n-gram
unless --speculative says otherwise) on the copy-heavy workload, against no speculation in the same run.

    pdserve bench spec-itl (--model-path DIR_OR_GGUF | --random-weights ARCH/SHAPE) [--batch-size 1 16]
        [--num-prompts 32] [--output-len 128] [--seed 0] [--output-json FILE]
        [engine flags: --num-speculative-tokens K, --speculative-max-batch M, --speculative draft ...]

For each --batch-size B: two engines, one after the other, with the engine flags given and
--max-running-requests B, the first with speculation off, the second with --speculative (ngram when
not given). Each runs bench/micro/copy_workload.py's prompts (edit, rewrite, quote: answers that repeat
their prompt) greedily at their natural lengths (EOS, or --output-len tokens) in waves of B requests
queued together, each wave once the previous one is done, after one unmeasured wave of other prompts
(the warm-up). The greedy answers must be token-identical off and on: in float32 the bench raises at a difference,
every token of a speculative engine is the plain engine's; in bf16 a near-tie may go the other way
(docs/architecture.md, "Speculative decoding"), so it counts the answers that differ.

ITL of a request = (time of its last token - time of its first) / (tokens - 1). The engine keeps no
time per token: each processing of a batch's result (EngineCore.process_batch_result, where the host
gets a step's tokens) is timed, and the tokens a request gained in it are given the time it ended —
when a server would stream them; a verify step's tokens share one time. Reported per B: the median and
p90 ITL off and on, their ratio (off / on: how many times lower ITL is with speculation), the mean
tokens a request gains per decode step on (off: 1), and the speculation counters of the measured
waves: verify steps, drafts proposed and accepted, accepted drafts per request verified.
NOTE a decode step of more requests than --speculative-max-batch runs plain (the default policy):
above it, only a wave's tail speculates; --speculative-max-batch 0 speculates at any batch size.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

from pdserve.bench.metrics import percentile
from pdserve.common.list_flag import ListFlag

SPEC_COUNTERS = (
    "spec_verify_steps",
    "spec_proposed_tokens",
    "spec_accepted_tokens",
    "spec_verified_requests",
    "spec_unconfirmed_tokens",
    "spec_overlapped_steps",
)


def add_parser(kinds) -> None:
    from pdserve.bench.random_weights import add_model_args
    from pdserve.common.config import EngineConfig, add_cli_args

    parser = kinds.add_parser(
        "spec-itl",
        help="Inter-token latency with and without speculative decoding on the copy-heavy workload.",
        description=__doc__.split("\n\n")[0],
    )
    add_model_args(parser, model_path_flag=False)  # --model-path comes with the engine flags
    parser.add_argument(
        "--batch-size", type=int, nargs="+", action=ListFlag, default=[1, 16], help="Requests per wave (each B)."
    )
    parser.add_argument("--num-prompts", type=int, default=32, help="Measured requests per engine.")
    parser.add_argument("--output-len", type=int, default=128, help="Most tokens of each answer (greedy).")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the copy prompts.")
    parser.add_argument("--output-json", default=None, metavar="FILE", help="Also write the JSON report here.")
    add_cli_args(parser, EngineConfig)
    parser.set_defaults(func=run)


def timed_wave(engine, prompts: list[list[int]], params) -> list[tuple[list[int], list[tuple[float, int]]]]:
    """Run `prompts` together to completion; per request, its output ids and (time, tokens so far) after
    each result processing that gave it tokens (time.perf_counter seconds)."""
    from pdserve.common.types import FinishReason

    reqs = []
    for prompt in prompts:
        req = engine.make_req(prompt, params)
        engine.scheduler.add_request(req)  # (Engine.add_request, keeping the Req to watch its tokens)
        reqs.append(req)
    stamps: dict[int, list[tuple[float, int]]] = {id(req): [] for req in reqs}
    process = engine.process_batch_result

    def stamped(batch, result):
        before = [len(req.output_ids) for req in batch.reqs]
        process(batch, result)
        now = time.perf_counter()
        for req, n in zip(batch.reqs, before):
            if id(req) in stamps and len(req.output_ids) > n:
                stamps[id(req)].append((now, len(req.output_ids)))

    engine.process_batch_result = stamped
    done = {}
    try:
        loop = engine.event_loop()
        while engine.busy():
            for completion in next(loop):
                done[completion.rid] = completion
    finally:
        del engine.process_batch_result  # (the class's again)
    for req in reqs:
        c = done[req.rid]
        if c.error is not None or c.finish_reason is FinishReason.ABORT:
            raise RuntimeError(f"request {c.rid} failed: {c.finish_reason.value} {c.error}")
    return [(done[req.rid].output_ids, stamps[id(req)]) for req in reqs]


def itl_and_steps(stamps: list[tuple[float, int]]) -> tuple[float, float] | None:
    """(ITL seconds, mean tokens per decode step) of one request; None with fewer than 2 tokens."""
    if not stamps or stamps[-1][1] < 2:
        return None
    (first, n_first), (last, n_last) = stamps[0], stamps[-1]
    return (last - first) / (n_last - 1), (n_last - n_first) / max(len(stamps) - 1, 1)


def run_engine(config, prompts: list[list[int]], warmup: list[list[int]], batch: int, output_len: int) -> dict:
    """One engine: the warm-up wave, then `prompts` in waves of `batch`; the answers, ITLs and counters."""
    from pdserve.common.engine.engine import Engine
    from pdserve.common.types import SamplingParams

    params = SamplingParams(max_new_tokens=output_len, temperature=0)
    engine = Engine(config)
    try:
        timed_wave(engine, warmup, params)
        before = dict(engine.scheduler.stats)
        answers, itls, steps = [], [], []
        for start in range(0, len(prompts), batch):
            for output_ids, stamps in timed_wave(engine, prompts[start : start + batch], params):
                answers.append(output_ids)
                measured = itl_and_steps(stamps)
                if measured is not None:
                    itls.append(measured[0])
                    steps.append(measured[1])
        counters = {k: engine.scheduler.stats.get(k, 0) - before.get(k, 0) for k in SPEC_COUNTERS}
        if not engine.is_idle():
            raise RuntimeError(f"the engine is not idle after the waves: {engine.stats()}")
    finally:
        engine.close()
        del engine
        release_engine_memory()
    if not itls:
        raise RuntimeError("no request gave two tokens: no inter-token latency to measure (raise --output-len)")
    return {"answers": answers, "itls": itls, "tokens_per_step": statistics.mean(steps), "counters": counters}


def release_engine_memory() -> None:
    """Give a closed engine's memory back before the next one sizes its KV cache from what is free
    (on an H200 the second engine found the first one's 120 GiB still taken: "no room for the KV
    cache"). NOTE two holders: torch's caching allocator keeps freed blocks reserved until
    empty_cache, and the engine froze the heap at start (common/gc_tuning.py), so whatever of it is
    cyclic is collected only once the heap is unfrozen."""
    import gc

    import torch

    gc.unfreeze()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def check_exact(off: list[list[int]], on: list[list[int]], strict: bool = True) -> int:
    """Speculation's contract: the plain engine's greedy tokens, every one. strict (float32): raise at
    the first difference; else (bf16, where a near-tie may go the other way) the answers that differ."""
    differ = 0
    for i, (a, b) in enumerate(zip(off, on, strict=True)):
        if a != b:
            at = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            message = (
                f"prompt {i}: the speculative answer differs from the plain one at token {at} "
                f"(plain {a[at : at + 4]}, speculative {b[at : at + 4]}; lengths {len(a)}, {len(b)})"
            )
            if strict:
                raise RuntimeError(message)
            print(f"NOTE {message}")
            differ += 1
    return differ


def batch_row(batch: int, off: dict, on: dict, num_tokens: int, differ: int = 0) -> dict:
    c = on["counters"]
    verified = c["spec_verified_requests"]
    row = {"batch_size": batch, "k": num_tokens, "requests": len(on["answers"]), "answers_differing": differ}
    row["output_tokens"] = sum(len(a) for a in on["answers"])
    for name, r in (("off", off), ("on", on)):
        row[f"itl_median_ms_{name}"] = statistics.median(r["itls"]) * 1e3
        row[f"itl_p90_ms_{name}"] = percentile(r["itls"], 90) * 1e3
        row[f"tokens_per_step_{name}"] = r["tokens_per_step"]
    row["itl_median_ratio"] = row["itl_median_ms_off"] / row["itl_median_ms_on"]
    row["itl_p90_ratio"] = row["itl_p90_ms_off"] / row["itl_p90_ms_on"]
    row |= c
    judged = c["spec_proposed_tokens"] - c.get("spec_unconfirmed_tokens", 0)  # (drafts dropped unjudged: not counted)
    row["acceptance"] = c["spec_accepted_tokens"] / judged if judged > 0 else 0.0
    row["accepted_per_verified_request"] = c["spec_accepted_tokens"] / verified if verified else 0.0
    return row


def run(args: argparse.Namespace) -> int:
    from pdserve.bench.micro.copy_workload import copy_prompts
    from pdserve.bench.random_weights import model_path_from_args
    from pdserve.bench.report import command_line, device_name, emit, table
    from pdserve.common.config import EngineConfig, from_cli_args
    from pdserve.common.tokenizer import load_tokenizer

    if min(args.batch_size) < 1 or args.num_prompts < 1 or args.output_len < 2:
        raise SystemExit("error: --batch-size and --num-prompts must be >= 1, --output-len >= 2")
    model_path_from_args(args)
    config = from_cli_args(args, EngineConfig)
    kind = config.speculative or "ngram"
    resolved = dataclasses.replace(config, speculative=kind).resolve()  # (refuses bad flags before any engine)
    tokenizer = load_tokenizer(resolved.model_path)
    prompts = copy_prompts(tokenizer, args.num_prompts, args.seed)
    warmup = copy_prompts(tokenizer, max(args.batch_size), args.seed + 1)
    rows = []
    for batch in args.batch_size:
        plain = dataclasses.replace(config, speculative="", draft_model_path="", max_running_requests=batch)
        spec = dataclasses.replace(config, speculative=kind, max_running_requests=batch)
        off = run_engine(plain, prompts, warmup[:batch], batch, args.output_len)
        on = run_engine(spec, prompts, warmup[:batch], batch, args.output_len)
        differ = check_exact(off["answers"], on["answers"], strict=resolved.dtype == "float32")
        rows.append(batch_row(batch, off, on, resolved.num_speculative_tokens, differ))
        if 0 < resolved.speculative_max_batch < batch:
            print(
                f"NOTE batch {batch} > --speculative-max-batch {resolved.speculative_max_batch}: its full decode "
                "steps run plain (--speculative-max-batch 0 speculates at any batch size)"
            )
    print(
        f"spec-itl: {kind} speculation, k {resolved.num_speculative_tokens}, {len(prompts)} copy prompts "
        f"(median {statistics.median(len(p) for p in prompts)} tokens), greedy, at most {args.output_len} tokens"
    )
    header = ["B", "ITL p50 off", "ITL p50 on", "off/on", "ITL p90 off", "ITL p90 on", "off/on", "tok/step on"]
    header += ["accepted/verified", "acceptance", "verify steps"]
    print(
        table(
            header,
            [
                [
                    r["batch_size"],
                    f"{r['itl_median_ms_off']:.2f} ms",
                    f"{r['itl_median_ms_on']:.2f} ms",
                    f"{r['itl_median_ratio']:.2f}x",
                    f"{r['itl_p90_ms_off']:.2f} ms",
                    f"{r['itl_p90_ms_on']:.2f} ms",
                    f"{r['itl_p90_ratio']:.2f}x",
                    f"{r['tokens_per_step_on']:.2f}",
                    f"{r['accepted_per_verified_request']:.2f}",
                    f"{r['acceptance']:.1%}",
                    r["spec_verify_steps"],
                ]
                for r in rows
            ],
        )
    )
    report = {
        "bench": "spec-itl",
        "speculative": kind,
        "num_speculative_tokens": resolved.num_speculative_tokens,
        "speculative_max_batch": resolved.speculative_max_batch,
        "speculative_overlap": resolved.speculative_overlap,
        "model": resolved.model_path,
        "device": device_name(resolved.device),
        "dtype": resolved.dtype,
        "num_prompts": len(prompts),
        "output_len": args.output_len,
        "rows": rows,
        "command": command_line(args.argv),
    }
    emit(report, args.output_json)
    return 0
