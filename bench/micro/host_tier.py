"""The host KV tier's copy bandwidth against the bus's (`--host-kv-cache-gb`,
common/engine/host_kv_pool.py), on one GPU:

    python -m pdserve.bench.micro.host_tier --shape llama/1b --pages 1 16 64 256 1024

For each batch of n pages (a page: every layer's K and V of `--page-size` tokens): HostKVPool.store
(device -> pinned host) and HostKVPool.load_async (host -> device, on the pool's own stream, as the
scheduler issues it), each timed by CUDA events around the call, median of `--repeats`; against a
plain pinned <-> device copy of the same bytes (one contiguous tensor: the bus's ceiling here).
Pages are drawn at random from the device pool (a served pool's free pages are scattered). The
loaded pages are checked against the stored ones before anything is timed.
"""

from __future__ import annotations

import argparse
import json
import random

import torch

from pdserve.bench.shapes import resolve_shape
from pdserve.common.engine.host_kv_pool import HostKVPool
from pdserve.common.engine.kv_pool import PagedKVPool
from pdserve.common.list_flag import ListFlag


def timed(fn, repeats: int) -> float:
    """Median device seconds of fn() (queued on the current stream or its own, then waited for)."""
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record(torch.cuda.current_stream())
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return sorted(times)[len(times) // 2]


def run(args) -> list[dict]:
    _, cfg = resolve_shape(args.shape)
    layers, kv_heads = cfg["num_hidden_layers"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    most = max(args.pages)
    device_pages = 2 * most + 1
    pool = PagedKVPool(device_pages, args.page_size, layers, kv_heads, head_dim, torch.bfloat16, "cuda")
    for b in [*pool.k_storage, *pool.v_storage]:
        b.normal_()
    host = HostKVPool(most, pool)
    rng = random.Random(0)
    rows = []
    for n in args.pages:
        source = rng.sample(range(1, device_pages), n)
        target = rng.sample([p for p in range(1, device_pages) if p not in source], n)
        slots = host.alloc(n)
        host.store(pool, source, slots)
        host.load_async(pool, slots, target).synchronize()  # (its slots are free again once it is done)
        assert host.num_free() == most
        for b in [*pool.k_storage, *pool.v_storage]:
            view = b.view(device_pages, args.page_size, kv_heads, head_dim)
            assert torch.equal(view[source], view[target]), "pages changed on the round trip"
        slots = host.alloc(n)
        size = n * host.page_bytes

        def load(slots=slots, target=target):  # load_async without giving the slots back
            host.stream.wait_stream(torch.cuda.current_stream())
            torch.cuda.current_stream().wait_event(host.load(pool, slots, target, stream=host.stream))

        store_s = timed(lambda: host.store(pool, source, slots), args.repeats)
        load_s = timed(load, args.repeats)
        pinned = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        on_device = torch.empty(size, dtype=torch.uint8, device="cuda")
        h2d_s = timed(lambda: on_device.copy_(pinned, non_blocking=True), args.repeats)
        d2h_s = timed(lambda: pinned.copy_(on_device, non_blocking=True), args.repeats)
        host.free(slots)
        rows.append(
            {
                "pages": n,
                "mib": size / (1 << 20),
                "load_gbps": size / load_s / 1e9,
                "store_gbps": size / store_s / 1e9,
                "h2d_gbps": size / h2d_s / 1e9,
                "d2h_gbps": size / d2h_s / 1e9,
            }
        )
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama/1b")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--pages", type=int, nargs="+", action=ListFlag, default=[1, 16, 64, 256, 1024])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a GPU")
    rows = run(args)
    print(f"{torch.cuda.get_device_name()}  {args.shape}  page {args.page_size} tokens")
    print("pages      MiB   load GB/s  h2d GB/s  (load/h2d)   store GB/s  d2h GB/s  (store/d2h)")
    for r in rows:
        print(
            f"{r['pages']:5d} {r['mib']:8.1f} {r['load_gbps']:11.1f} {r['h2d_gbps']:9.1f} "
            f"{r['load_gbps'] / r['h2d_gbps']:9.2f}   {r['store_gbps']:10.1f} {r['d2h_gbps']:9.1f} "
            f"{r['store_gbps'] / r['d2h_gbps']:9.2f}"
        )
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "shape": args.shape, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
