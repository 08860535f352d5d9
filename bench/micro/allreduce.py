"""All-reduce latency on N GPUs inside a CUDA graph, as a TP decode step runs it: NCCL against
torch's symmetric-memory kernels (torch.ops.symm_mem, built into torch: no extension).

    python -m pdserve.bench.micro.allreduce --gpus 2 --hidden 4096 --batch-size 64 128

For each batch size B: a [B * hidden] bf16 tensor all-reduced `--calls` times in one captured
graph, the median over 5 replays divided by the calls (µs per all-reduce). Results checked against
NCCL's before timing. Docs: docs/benchmarks/tensor-parallel.md, "Tensor parallelism on two GPUs".
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pdserve.common.list_flag import ListFlag

SYMM_MEM_OPS = ("one_shot_all_reduce", "two_shot_all_reduce_", "multimem_all_reduce_")


def per_call_us(fn, calls: int) -> float:
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(calls):
                fn()
    torch.cuda.synchronize()
    dist.barrier()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / calls * 1e3)
    return sorted(times)[len(times) // 2]


def rank_main(rank: int, args) -> None:
    import torch.distributed._symmetric_memory as symm_mem

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(args.port))
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", rank=rank, world_size=args.gpus, device_id=device)
    group = dist.group.WORLD.group_name
    lines = []
    for bs in args.batch_size:
        n = bs * args.hidden
        x = torch.randn(n, dtype=torch.bfloat16, device=device, generator=torch.Generator(device).manual_seed(rank))
        expected = x.clone()
        dist.all_reduce(expected)
        work = x.clone()
        lines.append(
            f"batch {bs:4d}  nccl                 {per_call_us(lambda: dist.all_reduce(work), args.calls):6.1f} us"
        )
        buf = symm_mem.empty(n, dtype=torch.bfloat16, device=device)
        symm_mem.rendezvous(buf, group)
        for name in SYMM_MEM_OPS:
            op = getattr(torch.ops.symm_mem, name, None)
            if op is None:
                lines.append(f"batch {bs:4d}  {name:20s} not in this torch")
                continue
            try:
                buf.copy_(x)
                out = op(buf, "sum", group)
                got = buf if out is None else out  # the in-place ops reduce into buf
                torch.testing.assert_close(got, expected, atol=0.05, rtol=0.02)
                lines.append(
                    f"batch {bs:4d}  {name:20s} {per_call_us(lambda: op(buf, 'sum', group), args.calls):6.1f} us"
                )
            except Exception as e:  # noqa: BLE001 - report (e.g. multicast not supported) and go on
                lines.append(f"batch {bs:4d}  {name:20s} failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
    if rank == 0:
        print(
            f"{torch.cuda.get_device_name()} x{args.gpus}, torch {torch.__version__}, hidden {args.hidden}, bf16, "
            f"{args.calls} all-reduces per graph",
            flush=True,
        )
        print("\n".join(lines), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--batch-size", type=int, nargs="+", action=ListFlag, default=[64, 128])
    ap.add_argument("--calls", type=int, default=64, help="All-reduces per captured graph (a step has ~2 per layer).")
    ap.add_argument("--port", type=int, default=29533)
    args = ap.parse_args()
    if torch.cuda.device_count() < args.gpus:
        raise SystemExit(f"needs {args.gpus} GPUs, {torch.cuda.device_count()} visible")
    mp.spawn(rank_main, args=(args,), nprocs=args.gpus)


if __name__ == "__main__":
    main()
