"""Where an offline run's time goes on the GPU: kernels by total device time, and GPU idle time.

    python -m pdserve.bench.micro.profile_offline --random-weights gpt2/small --num-prompts 128 \
        --input-len 256 --output-len 64

One warm-up `generate`, then one under torch.profiler; prints wall time, the summed kernel time
(the GPU is idle for the rest, counting overlap between streams as busy once) and the top kernels.

With --timeline, no profiler (whose host overhead widens every gap): CUDA events around each
forward on the forward stream and host clocks at each launch give, per forward, when the host
launched it and when the GPU ran it, relative to the call of `generate`: how long the host takes
before the first forward, the GPU idle between forwards, and the tail after the last one.
"""

from __future__ import annotations

import argparse
import random
import time

import torch


def main() -> None:
    from torch.profiler import ProfilerActivity, profile

    from pdserve.bench.random_weights import add_model_args, model_path_from_args
    from pdserve.common.engine.engine import Engine
    from pdserve.common.types import SamplingParams

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(ap)
    ap.add_argument("--num-prompts", type=int, default=128)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--max-prefill-tokens", type=int, default=16384)
    ap.add_argument("--chunked-prefill-size", type=int, default=8192)
    ap.add_argument("--timeline", action="store_true", help="Forward-by-forward timeline, no profiler.")
    args = ap.parse_args()
    engine = Engine(
        model_path=str(model_path_from_args(args)),
        device="cuda",
        max_prefill_tokens=args.max_prefill_tokens,
        chunked_prefill_size=args.chunked_prefill_size,
    )
    rng = random.Random(0)

    def prompts():
        return [[rng.randrange(5, engine.vocab_size) for _ in range(args.input_len)] for _ in range(args.num_prompts)]

    params = SamplingParams(max_new_tokens=args.output_len, temperature=0, ignore_eos=True)
    engine.generate(prompts(), params)
    batch = prompts()
    torch.cuda.synchronize()
    if args.timeline:
        timeline(engine, batch, params)
        return
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        engine.generate(batch, params)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    kernels = sorted(
        (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA), key=lambda e: e.time_range.start
    )
    busy, end = 0.0, 0.0
    first = kernels[0].time_range.start if kernels else 0
    for e in kernels:  # union of kernel intervals (us)
        s, t = e.time_range.start, e.time_range.end
        if t > end:
            busy += t - max(s, end)
            end = t
    print(
        f"wall {wall * 1e3:.1f} ms (profiled) | GPU busy {busy / 1e3:.1f} ms | "
        f"kernels span {(end - first) / 1e3:.1f} ms"
    )
    # Idle gaps over 0.3 ms on the GPU timeline, in order: where the host held the device up.
    gaps, end = [], first
    for e in kernels:
        if e.time_range.start - end > 300:
            gaps.append(((end - first) / 1e3, (e.time_range.start - end) / 1e3, e.name[:50]))
        end = max(end, e.time_range.end)
    print(
        f"{len(gaps)} GPU gaps > 0.3 ms, total {sum(g[1] for g in gaps):.1f} ms; "
        "the largest (at ms, length ms, next kernel):"
    )
    for g in sorted(gaps, key=lambda g: -g[1])[:12]:
        print(f"  at {g[0]:7.1f}  {g[1]:6.2f}  {g[2]}")
    averages = prof.key_averages()
    try:
        print(averages.table(sort_by="self_device_time_total", row_limit=18, max_name_column_width=60))
    except (KeyError, AttributeError):
        print(averages.table(sort_by="self_cuda_time_total", row_limit=18, max_name_column_width=60))


def timeline(engine, prompts, params) -> None:
    """Print per-forward host launch time and device interval, relative to the call of generate."""
    runner = engine.runner
    stream = runner.streams.forward_stream
    launch = runner.launch
    marks = []  # (mode, tokens, host launch s, start event, end event)

    def timed_launch(batch, info, slots):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        host = time.perf_counter()
        start.record(stream)
        result = launch(batch, info, slots)
        end.record(stream)
        marks.append((batch.mode.value, batch.num_tokens, host, time.perf_counter() - host, start, end))
        return result

    runner.launch = timed_launch
    origin = torch.cuda.Event(enable_timing=True)
    origin.record(stream)
    t0 = time.perf_counter()
    engine.generate(prompts, params)
    wall = time.perf_counter() - t0
    torch.cuda.synchronize()
    runner.launch = launch
    rows = [
        (mode, tokens, (host - t0) * 1e3, took * 1e3, origin.elapsed_time(s), origin.elapsed_time(e))
        for mode, tokens, host, took, s, e in marks
    ]
    busy = sum(e - s for *_, s, e in rows)
    gaps = [b[4] - a[5] for a, b in zip(rows, rows[1:])]
    print(
        f"wall {wall * 1e3:.2f} ms | {len(rows)} forwards, device time inside them {busy:.2f} ms | "
        f"host before the first launch {rows[0][2]:.2f} ms | GPU idle between forwards {sum(gaps):.2f} ms | "
        f"after the last forward ended {wall * 1e3 - rows[-1][5]:.2f} ms"
    )
    print("  mode     tokens  host launch at ms  launch took ms  device start ms  device ms  idle before ms")
    for i, (mode, tokens, host, took, s, e) in enumerate(rows):
        if i < 8 or i >= len(rows) - 3 or mode != "decode":
            idle = s - rows[i - 1][5] if i else s
            print(f"  {mode:7s} {tokens:7d} {host:17.2f} {took:15.3f} {s:16.2f} {e - s:10.3f} {idle:14.3f}")
    decode = [e - s for mode, *_, s, e in rows if mode == "decode"]
    if decode:
        decode.sort()
        print(f"  decode forwards: median {decode[len(decode) // 2]:.3f} ms device")


if __name__ == "__main__":
    main()
