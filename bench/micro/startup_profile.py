"""Where one server's start-up goes, function by function: its engine built in this process under cProfile.

    python -m pdserve.bench.micro.startup_profile --model-path PATH [--device cuda] [--role decode] [--top 30]

The engine a `decode-server` (or `prefill-server`) builds, made as its scheduler process makes it:
transformers imported with torch hidden (common/torch_free.py), its start-up clock's phases, structured
output's machinery warmed at start (as servers do), then the warm-up. Printed: the phases (the line a
server prints), then the functions by cumulative and by own time — what `pdserve up`'s breakdown
names but cannot explain (the H200 host's "weights" phase, for one: docs/benchmarks/startup-and-small-models.md).
The interpreter's start and the imports before the clock are outside the profile (`python -X importtime`
covers them), and so is every thread but this one: the grammar warm-up's shows as a wait on a lock.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--role", choices=["decode", "prefill"], default="decode")
    parser.add_argument("--top", type=int, default=30, help="Functions shown in each ordering.")
    args = parser.parse_args()

    from pdserve.common.torch_free import transformers_without_torch

    transformers_without_torch()  # (as the scheduler process does before it builds its engine)
    from pdserve.common.config import EngineConfig
    from pdserve.common.startup import StartupClock

    if args.role == "decode":
        from pdserve.decode.engine import DecodeEngine as Engine
    else:
        from pdserve.prefill.engine import PrefillEngine as Engine
    config = EngineConfig(model_path=args.model_path, device=args.device)
    clock = StartupClock()
    profile = cProfile.Profile()
    profile.enable()
    engine = Engine(config, f"startup-profile-{args.role}", startup=clock, warm_grammars=True)
    profile.disable()
    try:
        print(f"{type(engine).__name__} started: {clock.summary()}\n", flush=True)
        for order in ("cumulative", "tottime"):
            out = io.StringIO()
            pstats.Stats(profile, stream=out).sort_stats(order).print_stats(args.top)
            print(f"---- by {order} ----\n" + out.getvalue().split("\n\n", 1)[-1], flush=True)
    finally:
        engine.close()


if __name__ == "__main__":
    main()
