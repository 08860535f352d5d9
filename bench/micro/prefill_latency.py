"""Time to first token in the engine, one prompt at a time: what the host adds to a short prefill.

    python3 -m pdserve.bench.micro.prefill_latency --random-weights llama/1b --input-lens 32 256 1000 2000
    python3 -m pdserve.bench.micro.prefill_latency --random-weights llama/1b --prefill-cuda-graph-max-tokens 0

For each prompt length, --requests prompts of random tokens (no prefix hits), each alone through
`Engine.generate` for one output token, after --warmup unmeasured ones: the median and minimum wall
time, from the call to the returned completion (scheduling, the upload, the prefill forward, the
first token's sampling, its copy to the host and detokenization). Engine flags select the path:
the defaults replay prefill CUDA graphs on CUDA; `--prefill-cuda-graph-max-tokens 0` runs the same
prefills eagerly (run it as its own process: one engine per process, as in serving).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

import torch

from pdserve.common.list_flag import ListFlag


def main(argv: list[str] | None = None) -> int:
    from pdserve.bench.random_weights import add_model_args, model_path_from_args
    from pdserve.common.config import EngineConfig, add_cli_args, from_cli_args
    from pdserve.common.engine.engine import Engine
    from pdserve.common.types import SamplingParams

    parser = argparse.ArgumentParser(
        prog="python3 -m pdserve.bench.micro.prefill_latency",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_args(parser, model_path_flag=False)
    parser.add_argument(
        "--input-lens", type=int, nargs="+", action=ListFlag, default=[32, 256, 1000], help="Prompt lengths."
    )
    parser.add_argument("--requests", type=int, default=15, help="Measured prompts per length.")
    parser.add_argument("--warmup", type=int, default=3, help="Unmeasured prompts first, per length.")
    add_cli_args(parser, EngineConfig)
    args = parser.parse_args(argv)
    model_path_from_args(args)  # sets args.model_path for --random-weights
    config = from_cli_args(args, EngineConfig)
    start = time.perf_counter()
    engine = Engine(config)
    startup = time.perf_counter() - start
    cuda = engine.runner.device.type == "cuda"
    rng = random.Random(0)
    params = SamplingParams(max_new_tokens=1, temperature=0, ignore_eos=True)
    rows = []
    for length in args.input_lens:
        length = min(length, engine.max_context_len - 1)
        walls = []
        for i in range(args.warmup + args.requests):
            ids = [rng.randrange(5, engine.vocab_size) for _ in range(length)]
            if cuda:
                torch.cuda.synchronize()
            t = time.perf_counter()
            engine.generate([ids], params)
            if i >= args.warmup:
                walls.append((time.perf_counter() - t) * 1e3)
        rows.append({"input_len": length, "median_ms": statistics.median(walls), "min_ms": min(walls)})
    graphs = engine.runner.prefill_graphs
    device = torch.cuda.get_device_name(engine.runner.device) if cuda else "cpu"
    path = "prefill CUDA graphs" if graphs is not None else "eager prefill"
    print(
        f"{device}, {engine.config.dtype}, {path}, engine start {startup:.1f} s; one prompt at a time, 1 output token"
    )
    print("input tokens | median ms | min ms")
    for row in rows:
        print(f"{row['input_len']:>12} | {row['median_ms']:9.2f} | {row['min_ms']:6.2f}")
    print(
        json.dumps(
            {
                "bench": "prefill_latency",
                "device": device,
                "path": path,
                "startup_s": startup,
                "graph_replays": graphs.replays if graphs is not None else 0,
                "rows": rows,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
