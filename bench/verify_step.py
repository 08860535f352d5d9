"""A speculative verify step's cost against the plain decode step, at the same batch and context.

    python -m pdserve.bench.verify_step --random-weights llama/1b --batch-size 1 8 32 128 \
        --num-speculative-tokens 4 [--input-len 256] [--output-len 64]

One engine with `--speculative ngram`, its proposer replaced twice: first by one that proposes k
fixed tokens for every request at every step (so every step is a verify step of 1 + k positions
per request, whatever is accepted), then by one that never proposes (every step is a plain decode
step). CUDA events on the forward stream around each step's launch (forward + sample) give the
device times; the medians and their ratio are printed per batch size. A verify step pays when the
tokens it returns per request, 1 + accepted drafts, exceed that ratio — the break-even acceptance is
ratio - 1 drafts a step (`pdserve bench spec-replay` gives a workload's acceptance).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics

import torch


class FixedDrafts:
    """Proposes `k` copies of one token for every request (never fewer than its limit allows)."""

    def __init__(self, k: int, token: int):
        self.k, self.token = k, token

    def propose_for(self, req, limit: int) -> list[int]:
        return [self.token] * min(self.k, limit)

    def retain(self, reqs) -> None:
        pass


class NoDrafts(FixedDrafts):
    def __init__(self):
        super().__init__(0, 0)


def timed_steps(engine, prompts, params, verify: bool) -> list[float]:
    """Device milliseconds of every verify (or plain decode) step of one run, the first two dropped."""
    runner = engine.runner
    launch, events = runner.launch, []

    def timed_launch(batch, *args, **kwargs):
        if batch.verify != verify or (not verify and batch.mode.value != "decode"):
            return launch(batch, *args, **kwargs)
        stream = runner.streams.forward_stream
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        result = launch(batch, *args, **kwargs)
        end.record(stream)
        events.append((start, end))
        return result

    runner.launch = timed_launch
    try:
        outs = engine.generate(prompts, params)
    finally:
        runner.launch = launch
    assert all(len(o.output_ids) == params.max_new_tokens for o in outs), "a request stopped early"
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in events][2:]


def measure(engine, scheduler, args, bs: int) -> dict:
    from pdserve.common.types import SamplingParams

    rng = random.Random(0)
    prompts = [[rng.randrange(5, engine.vocab_size) for _ in range(args.input_len)] for _ in range(bs)]
    params = SamplingParams(max_new_tokens=args.output_len, temperature=0, ignore_eos=True)
    result = {"batch_size": bs, "k": args.num_speculative_tokens}
    for name, proposer, verify in (
        ("decode", NoDrafts(), False),
        ("verify", FixedDrafts(args.num_speculative_tokens, 7), True),
    ):
        scheduler.speculation.proposer = proposer
        timed_steps(engine, prompts, params, verify)  # warm-up
        ms = []
        for _ in range(args.repeats):
            ms += timed_steps(engine, prompts, params, verify)
        result[f"{name}_ms"] = statistics.median(ms)
        result[f"{name}_steps"] = len(ms)
    result["ratio"] = result["verify_ms"] / result["decode_ms"]
    return result


def main() -> None:
    from pdserve.bench.random_weights import add_model_args, model_path_from_args
    from pdserve.common.engine.engine import Engine

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(ap)
    ap.add_argument("--batch-size", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", help="Also write the results here.")
    args = ap.parse_args()

    path = model_path_from_args(args)
    bs = max(args.batch_size)
    engine = Engine(
        model_path=str(path),
        device="cuda",
        dtype="bfloat16",
        max_running_requests=bs,
        max_total_tokens=bs * (args.input_len + args.output_len + 2 * args.num_speculative_tokens + 32),
        disable_radix_cache=True,
        speculative="ngram",
        num_speculative_tokens=args.num_speculative_tokens,
        # Every step a verify step of k drafts a request: no batch limit, and k never lowered (the
        # fixed drafts are all rejected on random weights; the policy would take k down to 1).
        speculative_max_batch=0,
        speculative_fixed_k=True,
    )
    results = []
    try:
        scheduler = engine.scheduler
        for size in args.batch_size:
            r = measure(engine, scheduler, args, size)
            r["gpu"] = torch.cuda.get_device_name()
            r["model"] = str(path)
            results.append(r)
            print(json.dumps(r))
            print(
                f"{r['gpu']}: batch {size}, k {r['k']}: decode step {r['decode_ms']:.3f} ms, verify step "
                f"{r['verify_ms']:.3f} ms ({r['ratio']:.2f}x: pays from {r['ratio'] - 1:.2f} accepted drafts a step)",
                flush=True,
            )
    finally:
        engine.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
