"""Tuning sweep for the split-K decode GEMM (models/triton_gemm.py) against cuBLAS, on a GPU.

    python -m pdserve.bench.tune_gemm [--m 128] [--json out.json]

For every projection of the two benchmark models (GPT-2 small, Llama-1B shape) at M = the decode
batch, times cuBLAS (F.linear) and the Triton GEMM under a grid of tiles / splits / warps / stages,
each in a CUDA graph of many launches that rotates over enough weight copies that the L2 cache
cannot hold them (as in a real step, where the other layers' weights and the KV flush it).
Prints achieved weight-read bandwidth and the best configs. Kernels are compiled first in a pool of
processes (Triton's disk cache then serves the timing process).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
from concurrent.futures import ProcessPoolExecutor
import multiprocessing

import torch

SHAPES = {  # name: (N, K)
    "gpt2.qkv": (2304, 768),
    "gpt2.o": (768, 768),
    "gpt2.fc": (3072, 768),
    "gpt2.proj": (768, 3072),
    "gpt2.lm_head": (50257, 768),
    "llama.qkv": (3072, 2048),
    "llama.o": (2048, 2048),
    "llama.gate_up": (16384, 2048),
    "llama.down": (2048, 8192),
    "llama.lm_head": (128256, 2048),
}
L2_DEFEAT_BYTES = 256 << 20


def configs(m: int, n: int, k: int):
    from pdserve.common.models.triton_gemm import GemmConfig, _block_m

    bm = _block_m(m)
    for bn, bk, split, warps, stages in itertools.product((32, 64, 128), (64, 128, 256), (1, 2, 4, 8, 16), (4, 8), (3, 5)):
        k_blocks = -(-k // bk)
        tiles = -(-n // bn) * -(-m // bm)
        if split > k_blocks or tiles * split > 1100 or (split > 1 and tiles > 600):
            continue
        if stages * (bm * bk + bk * bn) * 2 > 200 * 1024:
            continue
        yield GemmConfig(bm, bn, bk, split, warps, stages)


def _compile(task):
    m, n, k, c = task
    from pdserve.common.models import triton_gemm as tg

    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    ws = tg.GemmWorkspace.create("cuda", partial_elems=1 << 24, tiles=1 << 14)
    try:
        tg.linear(x, w, None, ws, c)
        torch.cuda.synchronize()
        return None
    except Exception as e:  # out of resources: dropped from the sweep
        return f"{type(e).__name__}: {str(e)[:80]}"


def time_us(fn, calls: int, repeats: int = 7) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    del graph
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--m", type=int, default=128)
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES))
    ap.add_argument("--workers", type=int, default=max(1, min(14, (os.cpu_count() or 2) - 2)))
    ap.add_argument("--json")
    args = ap.parse_args()
    from pdserve.common.models import triton_gemm as tg

    m = args.m
    tasks = [(m, *SHAPES[s], c) for s in args.shapes for c in configs(m, *SHAPES[s])]
    print(f"{torch.cuda.get_device_name()}: M={m}, {len(tasks)} Triton configs over {len(args.shapes)} shapes", flush=True)
    with ProcessPoolExecutor(args.workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        failed = {t[1:]: err for t, err in zip(tasks, pool.map(_compile, tasks, chunksize=4)) if err}
    print(f"compiled ({len(failed)} configs failed)", flush=True)

    ws = tg.GemmWorkspace.create("cuda", partial_elems=1 << 24, tiles=1 << 14)
    report = {"gpu": torch.cuda.get_device_name(), "m": m, "shapes": {}}
    for name in args.shapes:
        n, k = SHAPES[name]
        nbytes = n * k * 2
        copies = max(2, -(-L2_DEFEAT_BYTES // nbytes))
        ws_list = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(copies)]
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)

        def tb_s(us):
            return nbytes / us / 1e6

        cublas = time_us(lambda: [torch.nn.functional.linear(x, w) for w in ws_list], calls=1) / copies
        row = {"cublas_us": cublas}
        line = f"\n{name} [{n}x{k}] {nbytes / 1e6:.1f} MB: cuBLAS {cublas:6.1f} us ({tb_s(cublas):.2f} TB/s)"
        if n % 64:
            padded = [torch.nn.functional.pad(w, (0, 0, 0, -n % 64)) for w in ws_list]
            cub_pad = time_us(lambda: [torch.nn.functional.linear(x, w) for w in padded], calls=1) / copies
            row["cublas_padded_us"] = cub_pad
            line += f" | cuBLAS padded to {n + (-n % 64)} rows {cub_pad:6.1f} us"
            del padded
        print(line, flush=True)
        results = []
        for c in [None, *configs(m, n, k)]:
            if c is not None and (n, k, c) in failed:
                continue
            us = time_us(lambda: [tg.linear(x, w, None, ws, c) for w in ws_list], calls=1) / copies
            results.append((us, c))
        default_us = results[0][0]
        results = sorted(results[1:], key=lambda r: r[0])
        best_us, best = results[0]
        err = ((tg.linear(x, ws_list[0], None, ws, best).float() - torch.nn.functional.linear(x, ws_list[0]).float()).norm()
               / torch.nn.functional.linear(x, ws_list[0]).float().norm()).item()
        print(f"  default {tg.default_config(m, n, k, tg.num_sms(x.device))}: {default_us:6.1f} us ({tb_s(default_us):.2f} TB/s)")
        for us, c in results[:8]:
            print(f"  {us:6.1f} us ({tb_s(us):.2f} TB/s)  {c}")
        print(f"  best vs cuBLAS: {cublas / best_us:.2f}x; best's rel. error vs cuBLAS {err:.1e}", flush=True)
        row.update(default_us=default_us, best=[(us, c.__dict__) for us, c in results[:8]], rel_err=err)
        report["shapes"][name] = row
        del ws_list
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
