"""Where one request's time to first token goes, one request at a time through a local stack.

    python3 -m pdserve.bench.micro.ttft_breakdown --random-weights gpt2/small [--input-len 256] [--requests 25]

Starts a router, a decode and a prefill server (as `bench serve` does), then, after --warmup
requests, times --requests streamed requests through the router (TTFT, and the whole answer of
--output-len tokens), and as many again paired by hand over gRPC, each hop timed:

    decode dest    Generate sent -> the KV destination back (the decode server holds the pages)
    prefill rpc    Prefill sent -> answered (the KV and the first token are at the decode server)
      prefill      the prefill server's own timing: arrival to first token, transfer excluded
      transfer     the prefill server's: WRITE posted -> done
    next token     Prefill answered -> the decode stream's first token after it

Medians and minimums in ms. Engine flags (--disable-cuda-graph, ...) reach both servers.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time

from pdserve.bench.random_weights import add_model_args, model_path_from_args
from pdserve.bench.workload import token_pool
from pdserve.common.config import EngineConfig, add_cli_args, from_cli_args

HOPS = ("decode dest", "prefill rpc", "  prefill", "  transfer", "next token")
RPC_TIMEOUT_S = 60.0


async def through_router(
    base_url: str, model: str, prompts: list[list[int]], output_len: int
) -> list[tuple[float, float]]:
    """(TTFT, end to end) in seconds per prompt, one request at a time, as `bench serve` times them."""
    from pdserve.bench.loadgen import OpenAIBackend, timed_request

    backend, out = OpenAIBackend(base_url, model), []
    for prompt in prompts:
        result = await timed_request(backend, prompt, output_len, RPC_TIMEOUT_S)
        if not result.success:
            raise RuntimeError(f"a request through the router failed: {result.error}")
        out.append((result.ttft, result.e2e))
    return out


async def by_hand(
    prefill: str, decode: str, prompts: list[list[int]], output_len: int, cluster_secret_file: str = ""
) -> list[tuple[float, ...]]:
    """The router's pairing (router/pairing.py) without the router: seconds of each hop in HOPS."""
    import grpc

    from pdserve.common.server_config import TrustConfig
    from pdserve.common.trust import load_trust, open_channel
    from pdserve.proto import pdserve_pb2 as pb
    from pdserve.proto import pdserve_pb2_grpc as pb_grpc

    trust = load_trust(TrustConfig(cluster_secret_file=cluster_secret_file))

    rng = random.Random(0)
    params = pb.SamplingParams(
        max_new_tokens=output_len,
        temperature=0.0,
        top_p=1.0,
        top_k=-1,
        repetition_penalty=1.0,
        ignore_eos=True,
        skip_special_tokens=True,
    )
    rows = []
    async with open_channel(decode, trust) as dch, open_channel(prefill, trust) as pch:
        for i, prompt in enumerate(prompts):
            req = pb.GenerateRequest(
                request_id=f"ttft-{i}", prompt_token_ids=prompt, params=params, bootstrap_room=rng.getrandbits(63)
            )
            t0 = time.perf_counter()
            call = pb_grpc.DecodeServiceStub(dch).Generate(req, timeout=RPC_TIMEOUT_S)
            first = await call.read()
            if first is grpc.aio.EOF or first.WhichOneof("response") != "destination":
                raise RuntimeError(f"the decode server answered {first} instead of a destination")
            t1 = time.perf_counter()
            answer = await pb_grpc.PrefillServiceStub(pch).Prefill(
                pb.PrefillRequest(request=req, destination=first.destination), timeout=RPC_TIMEOUT_S
            )
            if answer.HasField("error"):
                raise RuntimeError(f"prefill failed: {answer.error.message}")
            t2 = time.perf_counter()
            msg = await call.read()
            t3 = time.perf_counter()
            while msg is not grpc.aio.EOF and msg.WhichOneof("response") != "finish":
                msg = await call.read()
            rows.append((t1 - t0, t2 - t1, answer.timings.prefill_s, answer.timings.transfer_s, t3 - t2))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python3 -m pdserve.bench.micro.ttft_breakdown",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_args(parser, model_path_flag=False)
    parser.add_argument("--input-len", type=int, default=256, help="Prompt tokens.")
    parser.add_argument("--output-len", type=int, default=16, help="Tokens per answer.")
    parser.add_argument("--requests", type=int, default=25, help="Measured requests per path.")
    parser.add_argument("--warmup", type=int, default=5, help="Unmeasured requests first.")
    add_cli_args(parser, EngineConfig)
    args = parser.parse_args(argv)
    model_path = model_path_from_args(args)
    config = from_cli_args(args, EngineConfig)
    pool, rng = token_pool(model_path), random.Random(0)
    n = args.warmup + args.requests
    prompts = [[rng.choice(pool) for _ in range(args.input_len)] for _ in range(2 * n)]

    from pdserve.bench.stack import local_stack

    resolved = config.resolve()
    with local_stack(config, resolved.device, max_inflight=1024) as stack:
        routed = asyncio.run(through_router(stack.base_url, resolved.served_model_name, prompts[:n], args.output_len))
        hops = asyncio.run(
            by_hand(stack.prefill, stack.decode, prompts[n:], args.output_len, stack.cluster_secret_file)
        )
    routed, hops = routed[args.warmup :], hops[args.warmup :]

    def line(name: str, values) -> str:
        ms = [v * 1e3 for v in values]
        return f"{name:>14}: median {statistics.median(ms):8.2f} ms   min {min(ms):8.2f} ms"

    print(f"{model_path}, {args.input_len} prompt tokens, {args.requests} requests per path, one at a time")
    print(line("router TTFT", [r[0] for r in routed]))
    print(line(f"router {args.output_len} tok", [r[1] for r in routed]))
    for j, name in enumerate(HOPS):
        print(line(name, [row[j] for row in hops]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
