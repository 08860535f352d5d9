"""The host's share of a decode step: scheduling, batch building and result processing, per step.

    python -m pdserve.bench.micro.host_step [--num-prompts 256] [--output-len 64]

A tiny llama on the CPU whose forward is a stub (constant logits), so only the work the overlap
loop must hide behind the device's forward is timed: `Scheduler.get_next_batch_to_run`,
`BatchBuilder.build` and `Scheduler.process_batch_result` (medians over the decode steps of one
`generate`, after one warm-up `generate`). Deterministic enough on a quiet CPU to compare two
versions of the host path; on a GPU host the same code runs, faster.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time


def main() -> None:
    import torch

    from pdserve.common.tiny_model import make_tiny_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="pdserve-host-step-") as tmp:
        _measure(args, make_tiny_model(tmp, "llama", 0))


def _measure(args, path) -> None:
    import torch

    from pdserve.common.engine.engine import Engine
    from pdserve.common.types import SamplingParams

    engine = Engine(
        model_path=str(path),
        device="cpu",
        max_total_tokens=2 * args.num_prompts * (args.input_len + args.output_len),
        max_running_requests=args.num_prompts,
    )
    vocab = engine.vocab_size
    engine.runner.forward = lambda batch, ids, scored=None: torch.zeros(batch.batch_size, vocab)
    times: dict[str, list[float]] = {"schedule": [], "build": [], "process": []}

    def timed(name, fn):
        def wrapped(*a, **kw):
            start = time.perf_counter()
            out = fn(*a, **kw)
            times[name].append(time.perf_counter() - start)
            return out

        return wrapped

    s = engine.scheduler
    s.get_next_batch_to_run = timed("schedule", s.get_next_batch_to_run)
    s.process_batch_result = timed("process", s.process_batch_result)
    engine.builder.build = timed("build", engine.builder.build)
    prompts = [[0] + [5 + (i + j) % 400 for j in range(args.input_len - 1)] for i in range(args.num_prompts)]
    params = SamplingParams(max_new_tokens=args.output_len, temperature=0, ignore_eos=True)
    engine.generate(prompts, params)
    for v in times.values():
        v.clear()
    engine.generate(prompts, params)
    medians = {k: statistics.median(v) * 1e6 for k, v in times.items()}
    print(
        f"{args.num_prompts} requests, {args.output_len} decode steps: per step, median us: "
        + ", ".join(f"{k} {v:.0f}" for k, v in medians.items())
        + f"; total {sum(medians.values()):.0f}"
    )


if __name__ == "__main__":
    main()
