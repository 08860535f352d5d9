"""Tuning sweep for the decode-step kernels at batch 128 (~300-token contexts), on a GPU.

    python -m pdserve.bench.micro.tune_kernels [--layout | --attention | --fp8-attention | --decode-tiles]

Times, with CUDA graphs of many launches (median of repeats), the split-K decode attention for the
two benchmark shapes (Llama-1B: 32 heads / 8 KV heads; GPT-2: 12 heads MHA; head_dim 64) under
several block / warp / stage / split settings, rotating over 16 layers' KV so the L2 cache does
not hold it, and the fused small ops at their decode shapes. Prints achieved bandwidth. --layout
compares the pool's token-major layout with a head-major one under the same kernel.
"""

from __future__ import annotations

import itertools
import statistics

import torch


def time_us(fn, calls: int = 20, repeats: int = 7) -> float:
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
    return statistics.median(times)


def decode_case(bs: int, ctx: int, heads: int, d: int = 64, page: int = 16, device: str = "cuda"):
    """A decode batch over shuffled pages: (slots in the pool, req_to_token, rows, seq_lens, q, out)."""
    pages_per_req = -(-ctx // page)
    slots = (bs * pages_per_req + 1) * page
    pages = (torch.randperm(bs * pages_per_req, device=device) + 1).view(bs, pages_per_req)
    r2t = (pages[:, :, None] * page + torch.arange(page, device=device)).view(bs, -1).to(torch.int32)
    rows = torch.arange(bs, device=device)
    seq_lens = torch.full((bs,), ctx, device=device, dtype=torch.int64)
    q = torch.randn(bs, heads, d, device=device, dtype=torch.bfloat16)
    return slots, r2t, rows, seq_lens, q, torch.empty_like(q)


def attention_sweep(name: str, heads: int, kv_heads: int, bs: int = 128, ctx: int = 302, layers: int = 16) -> None:
    from pdserve.common.engine.attention import triton_decode as td

    d = 64
    slots, r2t, rows, seq_lens, q, out = decode_case(bs, ctx, heads, d)
    k_bufs = [torch.randn(slots, kv_heads, d, device="cuda", dtype=torch.bfloat16) for _ in range(layers)]
    v_bufs = [torch.randn_like(k) for k in k_bufs]
    ws = td.DecodeWorkspace(bs, heads, d, 16, "cuda")
    kv_bytes = 2 * bs * ctx * kv_heads * d * 2
    original = td._split_config
    print(
        f"\n{name}: decode attention, batch {bs}, context {ctx}, {heads}/{kv_heads} heads, "
        f"per layer {kv_bytes / 1e6:.0f} MB"
    )
    results = []
    for block_n, warps, stages, splits in itertools.product((32, 64, 128), (2, 4), (2, 3), (1, 2)):
        td._split_config = lambda *args, c=dict(BLOCK_N=block_n, num_warps=warps, num_stages=stages): c

        def run():
            for k, v in zip(k_bufs, v_bufs):
                td.decode_attention(q, k, v, out, r2t, rows, seq_lens, 0.125, None, splits, ws)

        try:
            us = time_us(run, calls=2) / layers
        except Exception as e:  # a config that does not compile (shared memory, registers)
            print(f"  BLOCK_N {block_n} warps {warps} stages {stages} splits {splits}: {type(e).__name__}")
            continue
        results.append((us, block_n, warps, stages, splits))
    td._split_config = original
    results.sort()
    for us, block_n, warps, stages, splits in results[:6] + [r for r in results if r[1:] == (64, 2, 2, 1)]:
        print(
            f"  {us:6.1f} us  {kv_bytes / us / 1e6:5.2f} TB/s  "
            f"BLOCK_N {block_n} warps {warps} stages {stages} splits {splits}"
        )


def layout_sweep(bs: int = 128, ctx: int = 300) -> None:
    """Decode attention over a token-major pool [slots, heads, dim] (pdserve's) against a
    head-major one [heads, slots, dim] (passed as a strided view), same kernel and config: how much
    the 128-byte head slices a whole token row apart cost in bandwidth."""
    from pdserve.common.engine.attention import triton_decode as td

    d = 64
    for name, heads, kv_heads, layers in (("GPT-2", 12, 12, 12), ("Llama-1B", 32, 8, 16)):
        slots, r2t, rows, seq_lens, q, out = decode_case(bs, ctx, heads, d)
        ws = td.DecodeWorkspace(bs, heads, d, 16, "cuda")
        splits = td.num_kv_splits_for(bs, heads, kv_heads, 16)
        kv_bytes = 2 * bs * ctx * kv_heads * d * 2
        for layout in ("token-major", "head-major"):
            if layout == "token-major":
                bufs = [torch.randn(slots, kv_heads, d, device="cuda", dtype=torch.bfloat16) for _ in range(2 * layers)]
            else:
                bufs = [
                    torch.randn(kv_heads, slots, d, device="cuda", dtype=torch.bfloat16).transpose(0, 1)
                    for _ in range(2 * layers)
                ]

            def run(bufs=bufs):
                for k, v in zip(bufs[:layers], bufs[layers:]):
                    td.decode_attention(q, k, v, out, r2t, rows, seq_lens, 0.125, None, splits, ws)

            us = time_us(run, calls=2) / layers
            print(f"  {name:8s} {layout:11s} {us:6.1f} us  {kv_bytes / us / 1e6:5.2f} TB/s")
            del bufs


def small_ops() -> None:
    from pdserve.common.engine.attention.triton_store import rope_store_kv, store_kv
    from pdserve.common.engine.models import triton_ops as ops

    t, hidden, inter, heads, kv_heads, d = 128, 2048, 8192, 32, 8, 64
    x = torch.randn(t, hidden, device="cuda", dtype=torch.bfloat16)
    res = torch.randn_like(x)
    w = torch.randn(hidden, device="cuda", dtype=torch.bfloat16)
    gate_up = torch.randn(t, 2 * inter, device="cuda", dtype=torch.bfloat16)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q, k, v = q.view(t, heads, d), k.view(t, kv_heads, d), v.view(t, kv_heads, d)
    pos = torch.randint(0, 300, (t,), device="cuda")
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, device="cuda").float() / d))
    k_buf = torch.zeros(100_000, kv_heads, d, device="cuda", dtype=torch.bfloat16)
    v_buf = torch.zeros_like(k_buf)
    loc = torch.randperm(100_000, device="cuda")[:t]
    print("\nsmall ops at batch 128 (Llama-1B shapes), us per call:")
    for name, fn in [
        ("rmsnorm", lambda: ops.rmsnorm(x, w, 1e-5)),
        ("rmsnorm + residual", lambda: ops.rmsnorm(x, w, 1e-5, res)),
        ("rope_", lambda: ops.rope_(q, k, pos, inv_freq)),
        ("silu_mul", lambda: ops.silu_mul(gate_up)),
        ("store_kv", lambda: store_kv(k_buf, v_buf, loc, k, v)),
        ("rope_store_kv (rope_ + store_kv)", lambda: rope_store_kv(q, k, v, pos, inv_freq, k_buf, v_buf, loc)),
        ("torch add (reference)", lambda: x + res),
    ]:
        print(f"  {time_us(fn, calls=100):6.2f}  {name}")


def gemm_sweep(m: int = 128, layers: int = 16) -> None:
    """The decode GEMMs (Llama-1B shapes, M = batch 128), weights rotated over 16 layers' copies."""
    shapes = {
        "qkv": (3072, 2048),
        "o": (2048, 2048),
        "gate_up": (16384, 2048),
        "down": (2048, 8192),
        "lm_head": (128256, 2048),
    }
    print(f"\nGEMMs at M={m}, bf16, us per call (TB/s of weight reads):")
    for name, (n, k) in shapes.items():
        count = 2 if name == "lm_head" else layers
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(count)]
        wts = [w.t().contiguous() for w in ws]
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        row = []
        for label, fn in [
            ("F.linear", lambda ws=ws: [torch.nn.functional.linear(x, w) for w in ws]),
            ("x @ W^T stored [K,N]", lambda wts=wts: [x @ w for w in wts]),
        ]:
            us = time_us(fn, calls=2) / count
            row.append(f"{label} {us:7.1f} ({n * k * 2 / us / 1e6:.2f})")
        torch.backends.cuda.preferred_blas_library("cublaslt")
        us = time_us(lambda ws=ws: [torch.nn.functional.linear(x, w) for w in ws], calls=2) / count
        torch.backends.cuda.preferred_blas_library("cublas")
        row.append(f"cublaslt {us:7.1f} ({n * k * 2 / us / 1e6:.2f})")
        print(f"  {name:8s} [{n}x{k}]: " + " | ".join(row))
        del ws, wts


def fp8_attention(layers: int = 8) -> None:
    """Decode and extend attention over a bf16 pool and a float8 one (K and V widened to bf16 or to
    fp16: triton_decode.FP8_WIDEN_TO_F16), Llama-8B's heads (32 / 8, head_dim 128), rotating over
    `layers` layers' pools so the L2 cache does not hold them. Prints us a layer and the pool's bytes
    read per us."""
    from pdserve.common.engine.attention import triton_decode as td
    from pdserve.common.engine.attention import triton_extend
    from pdserve.common.engine.attention.triton_extend import extend_attention

    heads, kv_heads, d = 32, 8, 128
    scale = torch.tensor([0.02], device="cuda")
    print(f"\nFP8 KV attention, {heads}/{kv_heads} heads, head_dim {d}, {layers} layers rotated")
    for bs, ctx in ((64, 160), (64, 1024), (256, 1024), (256, 2048)):
        slots, r2t, rows, seq_lens, q, out = decode_case(bs, ctx, heads, d)
        ws = td.DecodeWorkspace(bs, heads, d, 16, "cuda")
        splits = td.num_kv_splits_for(bs, heads, kv_heads, 16)
        row = []
        for name, dtype, widen in (("bf16", torch.bfloat16, False), ("fp8>bf16", torch.float8_e4m3fn, False),
                                   ("fp8>fp16", torch.float8_e4m3fn, True)):  # fmt: skip
            bufs = [torch.randn(slots, kv_heads, d, device="cuda").to(dtype) for _ in range(2 * layers)]
            kw = dict(k_scale=scale, v_scale=scale) if dtype != torch.bfloat16 else {}
            td.FP8_WIDEN_TO_F16 = widen

            def run(bufs=bufs, kw=kw):
                for k, v in zip(bufs[::2], bufs[1::2]):
                    td.decode_attention(q, k, v, out, r2t, rows, seq_lens, 0.088, None, splits, ws, **kw)

            us = time_us(run, calls=2) / layers
            kv_bytes = 2 * bs * ctx * kv_heads * d * bufs[0].element_size()
            row.append(f"{name} {us:7.1f} us ({kv_bytes / us / 1e6:4.2f} TB/s)")
            del bufs
        td.FP8_WIDEN_TO_F16 = True
        print(f"  decode batch {bs:3d} context {ctx:4d}: " + " | ".join(row))
    for bs, prefix, new in ((8, 0, 1024), (8, 1024, 512)):
        ctx = prefix + new
        slots, r2t, rows, _, _, _ = decode_case(bs, ctx, heads, d)
        q = torch.randn(bs * new, heads, d, device="cuda", dtype=torch.bfloat16)
        k_new, v_new = (torch.randn(bs * new, kv_heads, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        i32 = dict(dtype=torch.int32, device="cuda")
        lens = (torch.full((bs,), ctx, **i32), torch.full((bs,), new, **i32), torch.arange(0, bs * new, new, **i32))
        row = []
        for name, dtype, widen in (("bf16", torch.bfloat16, False), ("fp8>bf16", torch.float8_e4m3fn, False),
                                   ("fp8>fp16", torch.float8_e4m3fn, True)):  # fmt: skip
            triton_extend.FP8_WIDEN_TO_F16 = widen
            bufs = [torch.randn(slots, kv_heads, d, device="cuda").to(dtype) for _ in range(2 * layers)]
            kw = dict(k_scale=scale, v_scale=scale, k_new=k_new, v_new=v_new, has_prefix=prefix > 0)
            kw = kw if dtype != torch.bfloat16 else {}
            out = torch.empty_like(q)

            def run(bufs=bufs, kw=kw, out=out):
                for k, v in zip(bufs[::2], bufs[1::2]):
                    extend_attention(q, k, v, out, r2t, rows, *lens, new, 0.088, None, **kw)

            us = time_us(run, calls=2) / layers
            flops = 4 * bs * heads * d * new * (prefix + new / 2)
            row.append(f"{name} {us:7.1f} us ({flops / us / 1e6:5.0f} TFLOPS)")
            del bufs
        triton_extend.FP8_WIDEN_TO_F16 = True
        print(f"  extend batch {bs} prefix {prefix:4d} + {new:4d} new: " + " | ".join(row))
    decode_tile_sweep(torch.float8_e4m3fn, layers)
    decode_tile_sweep(torch.bfloat16, layers)


def decode_tile_sweep(dtype: torch.dtype, layers: int = 8) -> None:
    """The decode attention over a `dtype` pool at Llama-8B's heads under other tile settings, short
    and long contexts: the default's time, then the fastest four."""
    from pdserve.common.engine.attention import triton_decode as td

    heads, kv_heads, d = 32, 8, 128
    float8 = dtype == torch.float8_e4m3fn
    scale = torch.tensor([0.02], device="cuda")
    kw = dict(k_scale=scale, v_scale=scale) if float8 else {}
    name = "fp8" if float8 else "bf16"
    for bs, ctx in ((64, 160), (128, 160), (64, 1024), (256, 1024)):
        slots, r2t, rows, seq_lens, q, out = decode_case(bs, ctx, heads, d)
        ws = td.DecodeWorkspace(bs, heads, d, 16, "cuda")
        bufs = [torch.randn(slots, kv_heads, d, device="cuda").to(dtype) for _ in range(2 * layers)]
        original, timed = td._split_config, []
        default = original(d, heads // kv_heads, 0, 0, float8)
        for block_n, warps, stages, splits in itertools.product((32, 64, 128), (2, 4), (2, 3), (1, 2)):
            td._split_config = lambda *args, c=dict(BLOCK_N=block_n, num_warps=warps, num_stages=stages): c

            def run(splits=splits, bufs=bufs):
                for k, v in zip(bufs[::2], bufs[1::2]):
                    td.decode_attention(q, k, v, out, r2t, rows, seq_lens, 0.088, None, splits, ws, **kw)

            try:
                timed.append((time_us(run, calls=2) / layers, block_n, warps, stages, splits))
            except Exception as e:  # a config that does not compile (shared memory, registers)
                print(f"  BLOCK_N {block_n} warps {warps} stages {stages}: {type(e).__name__}")
        td._split_config = original
        default_splits = td.num_kv_splits_for(bs, heads, kv_heads, 16)
        print(
            f"  {name} decode batch {bs} context {ctx}: {default} (the default, {default_splits} splits) "
            + ", ".join(f"{t[0]:.1f} us" for t in timed if t[1:] == (*default.values(), default_splits))
        )
        for us, block_n, warps, stages, splits in sorted(timed)[:4]:
            print(f"  {name} decode batch {bs} context {ctx}: {us:6.1f} us BLOCK_N {block_n} warps {warps} "
                  f"stages {stages} splits {splits}")  # fmt: skip
        del bufs


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description="Decode-step kernel sweeps on a GPU; with no flag, all but --layout.")
    sweep = parser.add_mutually_exclusive_group()
    sweep.add_argument("--attention", action="store_true", help="the split-K decode attention alone")
    sweep.add_argument("--layout", action="store_true", help="token-major against head-major pool layout")
    sweep.add_argument("--fp8-attention", action="store_true", help="decode attention over an FP8 KV cache")
    sweep.add_argument("--decode-tiles", action="store_true", help="the decode GEMM tiles, FP8 and bf16")
    args = parser.parse_args()
    print(torch.cuda.get_device_name())
    if args.fp8_attention:
        fp8_attention()
        return
    if args.decode_tiles:
        decode_tile_sweep(torch.float8_e4m3fn)
        decode_tile_sweep(torch.bfloat16)
        return
    if args.layout:
        layout_sweep()
        return
    if args.attention:
        attention_sweep("Llama-1B", 32, 8)
        attention_sweep("GPT-2", 12, 12, layers=12)
        return
    gemm_sweep()
    small_ops()
    attention_sweep("Llama-1B", 32, 8)
    attention_sweep("GPT-2", 12, 12, layers=12)


if __name__ == "__main__":
    main()
