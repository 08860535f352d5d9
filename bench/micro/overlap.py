"""Overlap on vs off: decode inter-token latency at a few batch sizes, one process, one device.

    python bench/micro/overlap.py --device cuda --arch gpt2 --batch-sizes 1 8 32 64 --repeats 3

Uses the random-weight checkpoint of the given shape (bench/random_weights.py, built once), runs
B prompts of --input-len random tokens for --output-len tokens (ignore_eos, greedy) with the
overlapped and the serial loop alternately, and reports per batch size the median decode step
interval (ITL; every running request gets one token per step, so TPOT equals it here) and
output tokens/s. Medians over --repeats runs after one warm-up run per mode.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from pdserve.common.list_flag import ListFlag

# --arch keeps its meaning: the full-size shape of that architecture (bench/shapes.py).
ARCH_SHAPES = {"gpt2": "gpt2/small", "llama": "llama/1b"}


def decode_itl(engine, prompts, params) -> tuple[float, float, float]:
    """(median decode step interval ms, output tokens/s, median host scheduling + result
    processing ms per step: the work the overlap can hide) of one generate call."""
    stamps, host_ms = [], []
    process = engine.process_batch_result
    schedule, handle = engine.scheduler.get_next_batch_to_run, engine.scheduler.process_batch_result

    def timed(batch, result):
        out = process(batch, result)
        stamps.append((batch.mode.value, time.perf_counter()))
        return out

    def timed_host(fn):
        def wrapped(*args):
            t = time.perf_counter()
            out = fn(*args)
            host_ms.append((time.perf_counter() - t) * 1e3)
            return out

        return wrapped

    engine.process_batch_result = timed
    engine.scheduler.get_next_batch_to_run, engine.scheduler.process_batch_result = (
        timed_host(schedule),
        timed_host(handle),
    )
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    engine.process_batch_result = process
    engine.scheduler.get_next_batch_to_run, engine.scheduler.process_batch_result = schedule, handle
    decode = [t for mode, t in stamps if mode == "decode"]
    gaps = [b - a for a, b in zip(decode, decode[1:])]
    per_step = 2 * statistics.median(host_ms)  # one schedule + one result per step
    return statistics.median(gaps) * 1e3, sum(len(o.output_ids) for o in outs) / elapsed, per_step


def torch_sleep(cycles: int) -> None:
    import torch

    torch.cuda._sleep(cycles)


def sleep_cycles_per_ms() -> float:
    """Calibrate torch.cuda._sleep (it counts clock cycles) against CUDA event time."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)  # warm
    start.record()
    torch.cuda._sleep(50_000_000)
    end.record()
    end.synchronize()
    return 50_000_000 / start.elapsed_time(end)


def main() -> None:
    from pdserve.bench.random_weights import random_weight_checkpoint
    from pdserve.bench.shapes import resolve_shape
    from pdserve.common.engine.engine import Engine
    from pdserve.common.types import SamplingParams

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--arch", default="gpt2", choices=sorted(ARCH_SHAPES))
    ap.add_argument("--batch-sizes", type=int, nargs="+", action=ListFlag, default=[1, 8, 32, 64])
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", help="Also write the results here.")
    ap.add_argument(
        "--device-bound-ms",
        type=float,
        default=0.0,
        help="Synthetic: add a GPU sleep of this many ms to every forward, emulating a device-bound step.",
    )
    args = ap.parse_args()

    path = random_weight_checkpoint(ARCH_SHAPES[args.arch])
    vocab = resolve_shape(ARCH_SHAPES[args.arch])[1]["vocab_size"]
    engines = {
        mode: Engine(
            model_path=str(path),
            device=args.device,
            dtype=args.dtype,
            max_total_tokens=65536,
            max_running_requests=max(args.batch_sizes),
            disable_overlap_schedule=(mode == "off"),
        )
        for mode in ("on", "off")
    }
    if args.device_bound_ms:
        cycles = int(args.device_bound_ms * sleep_cycles_per_ms())
        for engine in engines.values():
            engine.runner.before_forward = lambda batch, c=cycles: torch_sleep(c)
    params = SamplingParams(max_new_tokens=args.output_len, temperature=0, ignore_eos=True)
    results = []
    for bs in args.batch_sizes:
        rng = random.Random(bs)
        prompts = [[rng.randrange(5, vocab) for _ in range(args.input_len)] for _ in range(bs)]
        runs = {"on": [], "off": []}
        for mode in ("on", "off"):
            decode_itl(engines[mode], prompts, params)  # warm-up
        for _ in range(args.repeats):
            for mode in ("on", "off"):  # alternate, so drift hits both modes alike
                if engines[mode].scheduler.tree_cache is not None:  # no prefix hits on repeats
                    engines[mode].scheduler.tree_cache.reset()
                runs[mode].append(decode_itl(engines[mode], prompts, params))
        row = {"batch_size": bs}
        for mode in ("on", "off"):
            row[f"itl_ms_{mode}"] = statistics.median(r[0] for r in runs[mode])
            row[f"tok_s_{mode}"] = statistics.median(r[1] for r in runs[mode])
            row[f"host_ms_{mode}"] = statistics.median(r[2] for r in runs[mode])
        row["itl_off_over_on"] = row["itl_ms_off"] / row["itl_ms_on"]
        results.append(row)
        print(json.dumps(row), flush=True)
    extra = f", synthetic device-bound forward +{args.device_bound_ms} ms" if args.device_bound_ms else ""
    print(f"\n{args.arch} {args.dtype} {args.input_len}->{args.output_len}, median of {args.repeats}{extra}")
    print("batch | ITL on (ms) | ITL off (ms) | off/on | tok/s on | tok/s off | host sched+proc/step (ms)")
    for r in results:
        print(
            f"{r['batch_size']:5d} | {r['itl_ms_on']:11.3f} | {r['itl_ms_off']:12.3f} | {r['itl_off_over_on']:6.2f} | "
            f"{r['tok_s_on']:8.0f} | {r['tok_s_off']:9.0f} | {r['host_ms_off']:.3f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
