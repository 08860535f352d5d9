"""A speculative verify step's cost against the plain decode step, at the same batch and context.

    python -m pdserve.bench.micro.verify_step --random-weights llama/1b --batch-size 1 8 32 128 \
        --num-speculative-tokens 4 [--input-len 256] [--output-len 64]

One engine with `--speculative ngram`, its proposer replaced twice: first by one that never proposes
(every step is a plain decode step), then by one that proposes k fixed tokens for every request at
every step (so every step is a verify step of 1 + k positions per request, whatever is accepted).
CUDA events on the forward stream around each step's launch (forward + sample) give the device
times; the medians and their ratio are printed per batch size. A verify step pays when the tokens
it returns per request, 1 + accepted drafts, exceed that ratio — the break-even acceptance is
ratio - 1 drafts a step (`pdserve bench spec-replay` gives a workload's acceptance).

    python -m pdserve.bench.micro.verify_step --random-weights llama/8b --draft-random-weights llama/1b ...
    (or --draft-model-path DIR: a checkpoint with the target's vocabulary)

With a draft model the engine runs `--speculative draft`, and during the verify steps the draft-model
proposer drafts for the batch too (its catch-up forward of the tokens the last step gave, then k - 1
one-token forwards, then the one read-back), timed around its `propose_batch`; the fixed drafts are still
what is verified, so every step keeps 1 + k positions a request (the draft model's own drafts are dropped;
with the fixed ones all rejected, each step's catch-up is one token a request, as after a step that
rejected the model's drafts). The report then has the draft proposing's median too, the sum draft +
verify, its ratio to the plain step and the break-even accepted drafts a step (sum ratio - 1). The draft
time on CUDA is the current stream's, from an event before the first draft kernel to one after the
read-back: the eager launches' host time counts where the device waits for it, as it does in a real step.
On CPU (--device cpu; the default without CUDA) every time is wall time, a check that the bench runs.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from pdserve.common.list_flag import ListFlag
from pdserve.common.scheduling.proposer import Proposer


class Stopwatch:
    """Milliseconds of what runs between each start() and stop(): CUDA events recorded on a stream (device
    time) on CUDA, else wall time (a CPU's forwards run as they are called)."""

    def __init__(self, cuda: bool):
        self.cuda, self.spans, self._start = cuda, [], None

    def _now(self, stream):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream if stream is not None else torch.cuda.current_stream())
        return event

    def start(self, stream=None) -> None:
        self._start = self._now(stream)

    def stop(self, stream=None) -> None:
        self.spans.append((self._start, self._now(stream)))

    def ms(self) -> list[float]:
        if not self.cuda:
            return [(end - start) * 1e3 for start, end in self.spans]
        torch.cuda.synchronize()
        return [start.elapsed_time(end) for start, end in self.spans]


class FixedDrafts(Proposer):
    """Proposes `k` copies of one token for every request (never fewer than its limit allows). With
    `draft` (a DraftProposer) the draft model drafts for the same requests first, timed by `clock`; its
    drafts are dropped, its bookkeeping (rollback, release) kept."""

    def __init__(self, k: int, token: int, draft: Proposer | None = None, clock: Stopwatch | None = None):
        self.k, self.token, self.draft, self.clock = k, token, draft, clock

    def propose_for(self, req, limit: int) -> list[int]:
        return [self.token] * min(self.k, limit)

    def propose_batch(self, reqs, limits) -> list[list[int]]:
        if self.draft is not None and any(limit > 0 for limit in limits):  # (a step with drafts to propose)
            self.clock.start()
            self.draft.propose_batch(reqs, limits)  # (ends with the drafts' read-back: a host sync)
            self.clock.stop()
        return super().propose_batch(reqs, limits)

    def retain(self, reqs) -> None:
        if self.draft is not None:
            self.draft.retain(reqs)

    def rollback(self, req) -> None:
        if self.draft is not None:
            self.draft.rollback(req)

    def release(self, req) -> None:
        if self.draft is not None:
            self.draft.release(req)

    def is_idle(self) -> bool:
        return self.draft is None or self.draft.is_idle()


def timed_steps(engine, prompts, params, verify: bool, clock: Stopwatch) -> list[float]:
    """Milliseconds of every verify (or plain decode) step of one run (`clock`: device time on CUDA), the
    first two dropped."""
    runner = engine.runner
    launch = runner.launch

    def timed_launch(batch, *args, **kwargs):
        if batch.verify != verify or (not verify and batch.mode.value != "decode"):
            return launch(batch, *args, **kwargs)
        stream = runner.streams.forward_stream if clock.cuda else None
        clock.start(stream)
        result = launch(batch, *args, **kwargs)
        clock.stop(stream)
        return result

    runner.launch = timed_launch
    try:
        outs = engine.generate(prompts, params)
    finally:
        runner.launch = launch
    assert all(len(o.output_ids) == params.max_new_tokens for o in outs), "a request stopped early"
    return clock.ms()[2:]


def measure(engine, scheduler, args, bs: int, draft: Proposer | None = None) -> dict:
    """The medians of one batch size: the plain decode step, the verify step of 1 + k positions a request
    and, with `draft` (the engine's DraftProposer), the draft model's proposing for those verify steps."""
    from pdserve.common.types import SamplingParams

    rng = random.Random(0)
    prompts = [[rng.randrange(5, engine.vocab_size) for _ in range(args.input_len)] for _ in range(bs)]
    params = SamplingParams(max_new_tokens=args.output_len, temperature=0, ignore_eos=True)
    result = {"batch_size": bs, "k": args.num_speculative_tokens}
    cuda = engine.runner.device.type == "cuda"
    for name, verify in (("decode", False), ("verify", True)):
        ms, drafting = [], []
        for repeat in range(1 + args.repeats):  # (the first: a warm-up)
            drafts = Stopwatch(cuda)
            k = args.num_speculative_tokens if verify else 0
            scheduler.speculation.proposer = FixedDrafts(k, 7, draft if verify else None, drafts)
            steps = timed_steps(engine, prompts, params, verify, Stopwatch(cuda))
            if repeat:
                ms += steps
                drafting += drafts.ms()[2:]
        result[f"{name}_ms"] = statistics.median(ms)
        result[f"{name}_steps"] = len(ms)
        if verify and draft is not None:
            result["draft_ms"] = statistics.median(drafting)
    result["ratio"] = result["verify_ms"] / result["decode_ms"]  # (the n-gram proposer's, whose drafting is host work)
    result["sum_ms"] = result.get("draft_ms", 0.0) + result["verify_ms"]
    result["sum_ratio"] = result["sum_ms"] / result["decode_ms"]
    result["break_even_drafts"] = result["sum_ratio"] - 1
    return result


def summary(r: dict) -> str:
    head = f"{r['gpu']}: batch {r['batch_size']}, k {r['k']}: decode step {r['decode_ms']:.3f} ms, "
    if "draft_ms" not in r:
        return head + (
            f"verify step {r['verify_ms']:.3f} ms ({r['ratio']:.2f}x: pays from {r['break_even_drafts']:.2f} "
            "accepted drafts a step)"
        )
    return head + (
        f"draft proposing {r['draft_ms']:.3f} ms + verify step {r['verify_ms']:.3f} ms = {r['sum_ms']:.3f} ms "
        f"({r['sum_ratio']:.2f}x: pays from {r['break_even_drafts']:.2f} accepted drafts a step)"
    )


def main() -> None:
    from pdserve.bench.random_weights import add_model_args, model_path_from_args, random_weight_checkpoint
    from pdserve.common.engine.engine import Engine

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(ap)
    ap.add_argument("--batch-size", type=int, nargs="+", action=ListFlag, default=[1, 8, 32, 128])
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--draft-model-path", default="", help="Time a draft model's proposing too: its checkpoint.")
    ap.add_argument("--draft-random-weights", default=None, metavar="ARCH/SHAPE", help="... or a random-weight one.")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", help="Also write the results here.")
    args = ap.parse_args()

    path = model_path_from_args(args)
    if args.draft_random_weights and args.draft_model_path:
        raise ValueError("give --draft-model-path or --draft-random-weights, not both")
    draft_path = args.draft_model_path
    if args.draft_random_weights:
        draft_path = str(random_weight_checkpoint(args.draft_random_weights))
    bs = max(args.batch_size)
    per_request = args.input_len + args.output_len + 2 * args.num_speculative_tokens + 32
    cuda = args.device == "cuda"
    engine = Engine(
        model_path=str(path),
        device=args.device,
        dtype="bfloat16" if cuda else "float32",
        max_running_requests=bs,
        context_length=per_request,
        max_total_tokens=bs * per_request,
        disable_radix_cache=True,
        speculative="draft" if draft_path else "ngram",
        draft_model_path=draft_path,
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
            r = measure(engine, scheduler, args, size, engine.proposer if draft_path else None)
            r["gpu"] = torch.cuda.get_device_name() if cuda else "cpu"
            r["model"] = str(path)
            if draft_path:
                r["draft_model"] = draft_path
            results.append(r)
            print(json.dumps(r))
            print(summary(r), flush=True)
    finally:
        engine.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
