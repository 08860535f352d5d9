"""The steady decode step against its memory floor.

    python -m pdserve.bench.micro.decode_step --random-weights llama/1b --batch-size 128 --input-len 270 --output-len 64

A decode step must at least read every weight once and every running request's KV once, so

    floor = (weight bytes + KV bytes read per step) / device-to-device copy rate

with the copy rate measured in the same run (a large device copy, counting bytes read plus bytes
written). The engine runs B prompts of --input-len random tokens for --output-len tokens
(ignore_eos, greedy), so contexts grow from input_len to input_len + output_len; the floor is taken
at the median decode step's context. Two step times are reported, medians over the decode steps
of --repeats runs:
    device  CUDA events around each decode step on the forward stream (forward + sample)
    loop    the interval between consecutive decode steps of the overlapped loop (what a client
            sees as inter-token latency; host work the overlap cannot hide shows up here)
--quantization fp8 runs the linear layers with FP8 weights (the engine's flag): the floor then
counts their bytes (one per weight, plus an fp32 scale per output row); compare with a run without.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from pdserve.common.list_flag import ListFlag


def copy_rate_bytes_per_s(device, size_bytes: int = 2 << 30, repeats: int = 20) -> float:
    """Median rate of a device-to-device copy, counting bytes read plus bytes written."""
    src = torch.randint(0, 255, (size_bytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    return 2 * size_bytes / statistics.median(times)


def weight_bytes(model: torch.nn.Module) -> int:
    """Every parameter once (tied embeddings count once: the LM head reads them in full). With
    --fp8-lm-head the head reads its float8 copy and a scale per row instead of its float weight."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    fp8_head = getattr(getattr(model, "lm_head", None), "fp8_logits", None)
    if fp8_head is not None:
        head = model.lm_head.weight
        total += -head.numel() * head.element_size() + sum(
            t.numel() * t.element_size() for t in (fp8_head.weight, fp8_head.scale)
        )
    return total


class StepTimer:
    """Device time and loop interval of every decode step of an engine's runs."""

    def __init__(self, engine):
        self.engine = engine
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.stamps: list[float] = []
        runner = engine.runner
        launch = runner.launch

        def timed_launch(batch, *args, **kwargs):
            if batch.mode.value != "decode":
                return launch(batch, *args, **kwargs)
            stream = runner.streams.forward_stream
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            result = launch(batch, *args, **kwargs)
            end.record(stream)
            self.events.append((start, end))
            self.stamps.append(time.perf_counter())
            return result

        runner.launch = timed_launch

    def run(self, prompts, params) -> tuple[list[float], list[float]]:
        self.events.clear()
        self.stamps.clear()
        outs = self.engine.generate(prompts, params)
        assert all(len(o.output_ids) == params.max_new_tokens for o in outs), "a request stopped early"
        torch.cuda.synchronize()
        device_ms = [s.elapsed_time(e) for s, e in self.events]
        loop_ms = [(b - a) * 1e3 for a, b in zip(self.stamps, self.stamps[1:])]
        # Drop the first steps (the batch fills in and its prefill is still in flight).
        return device_ms[2:], loop_ms[2:]


def profile_decode(timer: StepTimer, prompts, params) -> None:
    """Kernel time per decode step, by kernel (torch.profiler over one whole run)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        timer.run(prompts, params)
    steps = len(timer.events) + 2
    print(f"\nCUDA kernels over one run ({steps} decode steps, plus the prefill):")
    averages = prof.key_averages()
    try:
        print(averages.table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=70))
    except (KeyError, AttributeError):  # older torch names it after CUDA
        print(averages.table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=70))


def main() -> None:
    from pdserve.bench.micro import drop_kernels
    from pdserve.bench.random_weights import add_model_args, model_path_from_args
    from pdserve.common.config import read_hf_config
    from pdserve.common.engine.engine import Engine

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(ap)
    ap.add_argument(
        "--batch-size",
        type=int,
        nargs="+",
        action=ListFlag,
        default=[128],
        help="One engine, measured at each size in turn (--json then holds a list).",
    )
    ap.add_argument("--input-len", type=int, default=270)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--disable-overlap-schedule", action="store_true")
    ap.add_argument("--disable-cuda-graph", action="store_true")
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--tp-size", type=int, default=1, help="Ranks on GPUs 0..N-1; the floor is one rank's shard.")
    ap.add_argument("--tp-all-reduce", default="nccl", choices=("nccl", "symm"), help="The engine's --tp-all-reduce.")
    ap.add_argument(
        "--quantization",
        default="",
        choices=["", "fp8", "fp8-block"],
        help="fp8 (per-channel scales), fp8-block (128 x 128 block scales): the linear layers' weights in FP8 (the "
        "engine's --quantization); the floor counts their bytes and their scales'.",
    )
    ap.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "fp8_e4m3"],
        help="fp8_e4m3: the KV pool in FP8 (the engine's flag): the floor counts its bytes.",
    )
    ap.add_argument(
        "--fp8-lm-head",
        action="store_true",
        help="The LM head from a float8 copy (the engine's flag): the floor counts it.",
    )
    ap.add_argument(
        "--no-pdl",
        action="store_true",
        help="Launch every kernel without programmatic dependent launch (common/engine/pdl.py): slower, but "
        "--profile's kernel times are then each kernel's own (under PDL they include its wait for the one before).",
    )
    ap.add_argument(
        "--drop-kernels",
        nargs="+",
        default=[],
        choices=drop_kernels.CHOICES,
        help="Timing only (the tokens are garbage): these kernels launch nothing, so the step shows what it would take "
        "if their work cost nothing (bench/micro/drop_kernels.py).",
    )
    ap.add_argument("--json", help="Also write the result here.")
    ap.add_argument(
        "--profile", action="store_true", help="Also print the CUDA kernels of one more run, by total time."
    )
    args = ap.parse_args()

    if args.no_pdl:
        from pdserve.common.engine import pdl

        pdl.ENABLED = False  # (before the engine captures its graphs)
    if args.drop_kernels:
        drop_kernels.drop(args.drop_kernels)
    path = model_path_from_args(args)
    bs, ctx = max(args.batch_size), args.input_len + args.output_len
    engine = Engine(
        model_path=str(path),
        device="cuda",
        dtype="bfloat16",
        max_running_requests=bs,
        # NOTE: the pool must hold one sequence of the context length (the engine checks): at batch 1
        # or 2 of a short workload on a long-context model, bs * (ctx + 16) does not.
        max_total_tokens=max(bs * (ctx + 16), read_hf_config(str(path)).get("max_position_embeddings") or 0),
        disable_radix_cache=True,
        attention_backend=args.attention_backend,
        disable_overlap_schedule=args.disable_overlap_schedule,
        disable_cuda_graph=args.disable_cuda_graph,
        tp_size=args.tp_size,
        tp_all_reduce=args.tp_all_reduce,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        fp8_lm_head=args.fp8_lm_head,
    )
    results = []
    timer = StepTimer(engine)
    try:
        for size in args.batch_size:
            result = measure(timer, args, path, size)
            results.append(result)
            print(json.dumps(result))
            print(
                f"\n{result['gpu']}: batch {size}, tp {args.tp_size}, median context {result['median_context']}, "
                f"{result['quantization']} weights {result['weight_gb']:.2f} GB + KV {result['kv_gb_per_step']:.2f} GB "
                "per step per rank, "
                f"copy rate {result['copy_rate_tb_s']:.2f} TB/s (read + write)"
            )
            print(
                f"floor {result['floor_ms']:.3f} ms | device step {result['device_step_ms']:.3f} ms "
                f"({result['device_over_floor']:.2f}x floor) | loop step {result['loop_step_ms']:.3f} ms "
                f"({result['loop_over_floor']:.2f}x floor)",
                flush=True,
            )
    finally:
        engine.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results[0] if len(results) == 1 else results, f, indent=2)


def measure(timer: StepTimer, args, path, bs: int) -> dict:
    """Warm up, then the median device and loop step of `bs` requests over --repeats runs, against
    the floor."""
    from pdserve.common.types import SamplingParams

    engine = timer.engine
    rate = copy_rate_bytes_per_s(engine.runner.device)
    vocab = engine.vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(5, vocab) for _ in range(args.input_len)] for _ in range(bs)]
    params = SamplingParams(max_new_tokens=args.output_len, temperature=0, ignore_eos=True)
    timer.run(prompts, params)  # warm-up
    device_ms, loop_ms = [], []
    for _ in range(args.repeats):
        d, step = timer.run(prompts, params)
        device_ms += d
        loop_ms += step

    if args.profile:
        profile_decode(timer, prompts, params)
    w_bytes = weight_bytes(engine.runner.model)
    median_ctx = args.input_len + args.output_len // 2
    kv_bytes = bs * median_ctx * engine.runner.kv_pool.bytes_per_token()
    floor_ms = (w_bytes + kv_bytes) / rate * 1e3
    device, loop = statistics.median(device_ms), statistics.median(loop_ms)
    result = {
        "gpu": torch.cuda.get_device_name(),
        "model": str(path),
        "batch_size": bs,
        "median_context": median_ctx,
        "weight_gb": w_bytes / 1e9,
        "kv_gb_per_step": kv_bytes / 1e9,
        "copy_rate_tb_s": rate / 1e12,
        "floor_ms": floor_ms,
        "device_step_ms": device,
        "loop_step_ms": loop,
        "device_over_floor": device / floor_ms,
        "loop_over_floor": loop / floor_ms,
        "overlap": not args.disable_overlap_schedule,
        "cuda_graph": not args.disable_cuda_graph,
        "attention_backend": engine.config.attention_backend,
        "steps_measured": len(device_ms),
        "tp_size": args.tp_size,
        "quantization": engine.config.quantization or "none",
        "kv_cache_dtype": args.kv_cache_dtype,
        "fp8_lm_head": args.fp8_lm_head,
        "pdl": not args.no_pdl,
        "dropped_kernels": args.drop_kernels,
    }
    return result


if __name__ == "__main__":
    main()
