"""An FP8 linear layer's three CUDA paths against bf16, at a Llama shape's projections (no checkpoint).

    python -m pdserve.bench.micro.fp8_gemm --shape llama/8b --tokens 1 16 64 128 256 512 2048

Each path is what fp8.fp8_linear launches for one layer, the per-token activation quantization
included, captured in a CUDA graph (as the engine replays its decode steps) and replayed:

    bf16        F.linear
    row-wise    quantize + torch._scaled_mm with [M, 1] and [1, N] scales (cuBLASLt's epilogue), also
                with use_fast_accum (fp8.FP8_FAST_ACCUM)
    tensor-wise quantize + torch._scaled_mm with unit scales into fp32 + the Triton scale epilogue
    triton      quantize + fp8_kernels.fp8_gemm (one Triton launch, scales and bias in its epilogue),
                at gemm_config's tiles, tiles read by TMA (Hopper), and by pointer

Prints microseconds per layer and the tokens up to which tensor-wise beats row-wise: what
fp8.TENSORWISE_MAX_TOKENS should be on this GPU. --sweep-tokens also times fp8_gemm at every tile
configuration of SWEEP at those token counts and prints the fastest per layer (what gemm_config
should pick).
"""

from __future__ import annotations

import argparse
import json

import torch

from pdserve.bench.shapes import resolve_shape
from pdserve.common.list_flag import ListFlag

REPLAYS = 50
# fp8_gemm's configurations tried by --sweep-tokens: (BLOCK_N, BLOCK_K, SPLIT_K, num_stages, num_warps).
SWEEP = [(bn, bk, split, st, w) for bn in (32, 64, 128) for bk in (128, 256) for split in (1, 2, 4)
         for st, w in ((3, 4), (4, 4), (6, 4), (3, 8))]  # fmt: skip
# The sweep reads this many bytes of weights a replay, in copies of the layer's weight, as a decode
# step does (each layer's weight once): more than an H100's or H200's L2 (50 / 60 MB), which would
# otherwise hold a small projection's weight (o_proj: 16.8 MB) across replays.
SWEEP_WEIGHT_BYTES = 256 << 20


def projections(shape: str) -> dict[str, tuple[int, int]]:
    """name -> (K, N) of a Llama shape's fused projections."""
    arch, cfg = resolve_shape(shape)
    if arch not in ("llama", "mistral", "qwen2", "qwen3"):
        raise ValueError(f"--shape takes a Llama-family shape, got {shape!r} ({arch})")
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    qkv = (cfg["num_attention_heads"] + 2 * cfg["num_key_value_heads"]) * head_dim
    return {"qkv": (hidden, qkv), "o": (cfg["num_attention_heads"] * head_dim, hidden),
            "gate_up": (hidden, 2 * inter), "down": (inter, hidden)}  # fmt: skip


def replay_us(fn) -> float:
    """Microseconds per call of `fn`, captured once in a CUDA graph and replayed."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()  # (warm-up: Triton compiles, cuBLAS picks its kernel)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / REPLAYS


def measure(shape: str, tokens: list[int]) -> list[dict]:
    from pdserve.common.engine.models import fp8, fp8_kernels

    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, (k, n) in projections(shape).items():
        weight = torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.02
        wq, w_scale = fp8.quantize_per_channel(weight)
        for m in tokens:
            x = torch.randn(m, k, device="cuda", generator=gen, dtype=torch.bfloat16)

            def rowwise():
                xq, sx = fp8_kernels.quantize_per_token(x, fp8.MIN_AMAX)
                return torch._scaled_mm(xq, wq.t(), scale_a=sx, scale_b=w_scale.view(1, -1), out_dtype=x.dtype)

            def rowwise_fast():
                xq, sx = fp8_kernels.quantize_per_token(x, fp8.MIN_AMAX)
                return torch._scaled_mm(xq, wq.t(), scale_a=sx, scale_b=w_scale.view(1, -1), out_dtype=x.dtype,
                                        use_fast_accum=True)  # fmt: skip

            def tensorwise():
                xq, sx = fp8_kernels.quantize_per_token(x, fp8.MIN_AMAX)
                return fp8.tensorwise_fp8_mm(xq, sx, wq, w_scale, None, x.dtype)

            row = {"layer": name, "K": k, "N": n, "tokens": m}
            row |= {"bf16_us": replay_us(lambda: torch.nn.functional.linear(x, weight))}
            row |= {"rowwise_us": replay_us(rowwise), "tensorwise_us": replay_us(tensorwise)}
            row |= {"rowwise_fast_accum_us": replay_us(rowwise_fast)}
            row |= {"triton_us": replay_us(lambda: triton_path(x, wq, w_scale, None))}
            row |= {"triton_pointer_us": replay_us(lambda: triton_path(x, wq, w_scale, None, tma=False))}
            rows.append(row)
            print(
                f"{name:8s} K {k:6d} N {n:6d} M {m:5d}: bf16 {row['bf16_us']:7.1f} us, row-wise "
                f"{row['rowwise_us']:7.1f} us (fast accumulation {row['rowwise_fast_accum_us']:7.1f}), "
                f"tensor-wise {row['tensorwise_us']:7.1f} us, "
                f"triton {row['triton_us']:7.1f} us (pointer kernel {row['triton_pointer_us']:7.1f})",
                flush=True,
            )
    return rows


def triton_path(x, wq, w_scale, config, tma=None):
    from pdserve.common.engine.models import fp8, fp8_kernels

    xq, sx = fp8_kernels.quantize_per_token(x, fp8.MIN_AMAX)
    return fp8_kernels.fp8_gemm(xq, sx, wq, w_scale, None, x.dtype, config, tma=tma)


def sweep(shape: str, tokens: list[int]) -> list[dict]:
    """fp8_gemm alone (its input quantized once) at every configuration of SWEEP (BLOCK_M from
    gemm_config) and at gemm_config's, over SWEEP_WEIGHT_BYTES of weight copies a replay: the
    fastest first per layer."""
    from pdserve.common.engine.models import fp8, fp8_kernels

    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, (k, n) in projections(shape).items():
        weight = torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.02
        wq, w_scale = fp8.quantize_per_channel(weight)
        copies = [wq] + [wq.clone() for _ in range(SWEEP_WEIGHT_BYTES // wq.numel())]
        for m in tokens:
            x = torch.randn(m, k, device="cuda", generator=gen, dtype=torch.bfloat16)
            default = fp8_kernels.gemm_config(m, n, k)
            xq, sx = fp8_kernels.quantize_per_token(x, fp8.MIN_AMAX)  # (once: the GEMM alone is timed)

            def layers(cfg):
                return [fp8_kernels.fp8_gemm(xq, sx, w, w_scale, None, x.dtype, cfg) for w in copies]

            timed = []
            for bn, bk, split, stages, warps in SWEEP:
                cfg = {"BLOCK_N": bn, "BLOCK_M": default["BLOCK_M"], "BLOCK_K": bk, "SPLIT_K": split,
                       "num_stages": stages, "num_warps": warps}  # fmt: skip
                try:
                    timed.append((replay_us(lambda cfg=cfg: layers(cfg)) / len(copies), cfg))
                except Exception as e:  # (a configuration that does not fit shared memory)
                    print(f"  {name} M {m} {cfg}: {type(e).__name__}", flush=True)
            timed.sort(key=lambda t: t[0])
            us = replay_us(lambda: layers(default)) / len(copies)
            print(f"sweep {name:8s} K {k:6d} N {n:6d} M {m:5d}: {us:7.1f} us gemm_config's {default}", flush=True)
            for us, cfg in timed[:3]:
                rows.append({"layer": name, "K": k, "N": n, "tokens": m, "us": us, **cfg})
                print(f"sweep {name:8s} K {k:6d} N {n:6d} M {m:5d}: {us:7.1f} us {cfg}", flush=True)
    return rows


def crossover(rows: list[dict], tokens: list[int]) -> int:
    """The most tokens up to which tensor-wise is at least as fast as row-wise summed over the layers."""
    best = 0
    for m in sorted(tokens):
        at = [r for r in rows if r["tokens"] == m]
        if sum(r["tensorwise_us"] for r in at) > sum(r["rowwise_us"] for r in at):
            break
        best = m
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama/8b")
    parser.add_argument("--tokens", type=int, nargs="+", action=ListFlag, default=[1, 16, 64, 128, 256, 512, 2048])
    parser.add_argument("--sweep-tokens", type=int, nargs="*", action=ListFlag, default=[])
    parser.add_argument("--output-json", default="")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (FP8 GEMMs: compute capability 8.9 or later)")
    swept = sweep(args.shape, args.sweep_tokens) if args.sweep_tokens else []
    rows = measure(args.shape, args.tokens)
    best = crossover(rows, args.tokens)
    print(f"{torch.cuda.get_device_name()}, {args.shape}: tensor-wise at least as fast as row-wise up to {best} tokens")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"shape": args.shape, "device": torch.cuda.get_device_name(), "rows": rows,
                       "tensorwise_up_to": best, "sweep": swept}, f, indent=1)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
