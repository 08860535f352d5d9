"""How many prefill and decode servers a local deployment runs, and whether the router disaggregates:
the user's flags where given, else a default by where the servers run.

    choose_layout(num_gpus, --num-prefill, --disagg-policy, --num-decode, tp, weights_share) -> Layout
                                    (a flag None: not given; weights_share: checkpoint_bytes over a GPU's)

On the CPU the default is one prefill and one decode server, every request disaggregated. On one GPU
both roles share it: the default is the layout that won the one-GPU study's mixed workload
(ONE_GPU_DEFAULT: the pair, side by side under MPS). On two or more GPUs (TP 1) it is that pair on
every GPU, the layout that won the two-GPU study (PAIRS_WHY). A layout that shares a GPU falls back,
where MPS cannot be had (router/gpu_sharing.py), to one that does not: two servers time-slicing one
GPU serve several times less.
"""

from __future__ import annotations

import os
from typing import NamedTuple


class Layout(NamedTuple):
    num_prefill: int
    disagg_policy: str  # the router's --disagg-policy
    why: str  # printed at start: where the layout came from
    asked: bool = False  # --num-prefill was given: kept as it is
    num_decode: int = 1

    @property
    def colocated(self) -> bool:
        return self.num_prefill == 0


COLOCATED = ("never", 0)  # (--disagg-policy, --num-prefill)
PAIR = ("always", 1)
# The one-GPU study's mixed workload picks it (docs/benchmarks/host-tier-and-multi-turn.md, "The study's third
# slice"): on one H200, Llama-1B shape, lognormal lengths (medians 256 -> 256), TTFT 1 s / TPOT 2.8 ms SLOs, a prefill
# and a decode server under MPS kept TPOT p90 at 2.05 / 2.90 ms at 64 / 128 req/s where one colocated
# server's prefills between decode steps pushed it to 3.10 / 6.38 ms: goodput 64 req/s against none,
# and at 256 req/s 39.8k output tok/s against 36.8k. (The decode-heavy slice: 2x the goodput; the
# prefill-heavy one a tie; a burst of fixed short prompts all at once is colocated's, 1.75x.) With
# prefill capped at 50% of the SMs (router/gpu_sharing.py) the pair's goodput doubled again (>= 128
# req/s), and it won the prefill-heavy slice too (>= 56 req/s against < 40).
ONE_GPU_DEFAULT = PAIR
ONE_GPU_WHY = (
    "one GPU: a prefill + a decode server side by side under MPS, prefill on at most half the SMs (on the "
    "study's mixed workload they met TTFT 1 s / TPOT 2.8 ms at 128 req/s where one colocated server missed "
    "them at 64, docs/benchmarks/README.md); --num-prefill 0 runs one colocated server"
)

# The two-GPU study picked a prefill server on one GPU and a decode server on the other over two
# colocated replicas (docs/benchmarks/two-gpus.md, "The disaggregation study on two GPUs": 2x their
# goodput on every slice). Its sequel picks the one-GPU pair on each GPU over that (docs/benchmarks/two-gpus.md,
# "A pair on each GPU"): on two H200s, Llama-1B shape, TTFT 1 s / TPOT 2.4-3 ms SLOs, two prefill and two
# decode servers (each GPU a prefill and a decode server under MPS, prefill on at most half its SMs)
# sustained 256 req/s on the mixed workload where the split pair sustained 128, >= 256 against 192 on the
# decode-heavy one, and tied at 128 on the prefill-heavy one: a decode server's step is memory-bound,
# and the split layout leaves the decode GPU's compute and the prefill GPU's bandwidth idle.
# NOTE measured with weights of 2% of a GPU (Llama-1B shape, two H200s); the one-GPU pair still won
# at 11% (Llama-8B shape, one H200: docs/benchmarks/one-gpu.md). Each server of a pair holds the
# weights in half a GPU, so a larger model would leave it little KV room: past PAIRS_MAX_WEIGHTS_SHARE
# of the smallest GPU (or where either is unknown) the default is the split pair, as before.
PAIRS_MAX_WEIGHTS_SHARE = 0.125
PAIRS_WHY = (
    "{n} GPUs: a prefill + a decode server side by side under MPS on each GPU, prefill on at most half the "
    "SMs (on the two-GPU study's mixed workload they met TTFT 1 s / TPOT 2.8 ms at 2x the rate a prefill "
    "server on one GPU and a decode server on the other did, docs/benchmarks/README.md); --num-prefill 1 "
    "--num-decode 1 runs that split pair"
)
SPLIT_WHY = (
    "two or more GPUs: a prefill server and decode servers on GPUs of their own (on the two-GPU study's "
    "workloads the pair met the SLOs at 2x the rate two colocated replicas did, docs/benchmarks/README.md); "
    "--num-prefill 0 --num-decode N runs N colocated replicas"
)


def choose_layout(
    num_gpus: int,
    num_prefill: int | None,
    disagg_policy: str | None,
    num_decode: int | None = None,
    tp: int = 1,
    weights_share: float | None = None,
) -> Layout:
    """The layout from the flags (None: not given). `num_gpus`: the GPUs the servers are placed on
    (0: the CPU); `tp`: the larger of --prefill-tp and --decode-tp; `weights_share`: the checkpoint's
    bytes over the smallest of those GPUs' memory (None: unknown)."""
    decode = 1 if num_decode is None else num_decode
    if num_prefill is not None:
        if num_prefill < 0:
            raise ValueError(f"--num-prefill must be >= 0, got {num_prefill}")
        policy = disagg_policy or ("never" if num_prefill == 0 else "always")
        if num_prefill == 0 and policy != "never":
            raise ValueError("--num-prefill 0 needs --disagg-policy never (decode servers then prefill every request)")
        return Layout(num_prefill, policy, "as asked", asked=True, num_decode=decode)
    if disagg_policy == "never":
        return Layout(0, "never", "--disagg-policy never: decode servers prefill every request", num_decode=decode)
    if num_gpus == 1 and disagg_policy is None:
        policy, prefill = ONE_GPU_DEFAULT
        return Layout(prefill, policy, ONE_GPU_WHY, num_decode=decode)
    if num_gpus >= 2 and disagg_policy is None:
        fits = weights_share is not None and weights_share <= PAIRS_MAX_WEIGHTS_SHARE
        if num_decode is None and tp == 1 and fits:
            return Layout(num_gpus, "always", PAIRS_WHY.format(n=num_gpus), num_decode=num_gpus)
        why = SPLIT_WHY
        if num_decode is None and tp == 1 and weights_share is None:
            why += "; not a pair on each GPU: the GPUs' memory is unknown"
        elif num_decode is None and tp == 1:
            why += (
                f"; not a pair on each GPU: the weights take {weights_share:.0%} of the smallest GPU "
                f"(a pair's at most {PAIRS_MAX_WEIGHTS_SHARE:.1%})"
            )
        return Layout(1, "always", why, num_decode=decode)
    return Layout(1, disagg_policy or "always", "the default: one prefill server", num_decode=decode)


def without_mps(layout: Layout, reason: str, num_gpus: int = 1) -> Layout:
    """The default layout once MPS turned out not to be had (an asked-for one is kept): on one GPU
    one colocated server; the pairs on several GPUs become the split pair (a prefill server on one
    GPU, a decode server on each other one), which shares none."""
    if layout.asked or layout.colocated:
        return layout
    if num_gpus >= 2 and layout.num_prefill == num_gpus == layout.num_decode:
        return Layout(
            1,
            "always",
            f"MPS cannot be had ({reason}): a prefill server on one GPU, a decode server on each other one",
            num_decode=num_gpus - 1,
        )
    return Layout(
        0,
        "never",
        f"MPS cannot be had ({reason}): one colocated server instead of two time-slicing the GPU",
        num_decode=layout.num_decode,
    )


# NOTE a GGUF's weights are dequantized at load (common/config.py): a Q4 file's grow ~3.5x on the GPU.
# Reading its tensors' sizes takes gguf's reader seconds (it parses the whole vocabulary), so the file's
# size is scaled by what 16-bit weights take over 4.5 bits (Q4_0's): over, not under, for the usual types.
GGUF_GROWTH = 16 / 4.5


def checkpoint_bytes(model_path: str) -> int:
    """About the bytes a checkpoint's weights take on the GPU: a directory's safetensors (else .bin /
    .pt) files at its top level, or a GGUF file's size × GGUF_GROWTH."""
    if os.path.isfile(model_path):
        return int(os.path.getsize(model_path) * GGUF_GROWTH)
    names = os.listdir(model_path) if os.path.isdir(model_path) else []
    for suffixes in ((".safetensors",), (".bin", ".pt")):
        sizes = [os.path.getsize(os.path.join(model_path, n)) for n in names if n.endswith(suffixes)]
        if sizes:
            return sum(sizes)
    ggufs = [os.path.join(model_path, n) for n in names if n.endswith(".gguf")]
    return int(sum(map(os.path.getsize, ggufs)) * GGUF_GROWTH)
