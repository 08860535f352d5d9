"""How many prefill servers a local deployment runs, and whether the router disaggregates: the
user's flags where given, else a default by where the servers run.

    choose_layout(num_gpus, --num-prefill or None, --disagg-policy or None) -> Layout

On the CPU and on two or more GPUs the default is one prefill and one decode server, every request
disaggregated. On one GPU both roles would share it, so the default is the layout that served the
most there (ONE_GPU_DEFAULT, measured: docs/benchmarks.md, "One GPU"); and a layout that shares a
GPU falls back to one colocated server where MPS cannot be had (router/gpu_sharing.py): two servers
time-slicing one GPU serve several times less.
"""

from __future__ import annotations

from typing import NamedTuple


class Layout(NamedTuple):
    num_prefill: int
    disagg_policy: str  # the router's --disagg-policy
    why: str  # printed at start: where the layout came from
    asked: bool = False  # --num-prefill was given: kept as it is

    @property
    def colocated(self) -> bool:
        return self.num_prefill == 0


COLOCATED = ("never", 0)  # (--disagg-policy, --num-prefill)
# On one H200 (GPT-2 shape, 1024 x 256 -> 256, one call): one colocated server 93.0k output tok/s all at
# once and 99.2k at 256 in flight; a prefill and a decode server under MPS 53.1k and 62.2k, with SM shares
# 70:100 53.4k and 54.5k (docs/benchmarks.md, "One GPU").
ONE_GPU_DEFAULT = COLOCATED
ONE_GPU_WHY = (
    "one GPU: one colocated server (served 1.6-1.75x a prefill + decode pair under MPS on an H200, "
    "docs/benchmarks.md); --num-prefill 1 runs the pair"
)


def choose_layout(num_gpus: int, num_prefill: int | None, disagg_policy: str | None) -> Layout:
    """The layout from the flags (None: not given). `num_gpus`: the GPUs the servers are placed on
    (0: the CPU)."""
    if num_prefill is not None:
        if num_prefill < 0:
            raise ValueError(f"--num-prefill must be >= 0, got {num_prefill}")
        policy = disagg_policy or ("never" if num_prefill == 0 else "always")
        if num_prefill == 0 and policy != "never":
            raise ValueError("--num-prefill 0 needs --disagg-policy never (decode servers then prefill every request)")
        return Layout(num_prefill, policy, "as asked", asked=True)
    if disagg_policy == "never":
        return Layout(0, "never", "--disagg-policy never: decode servers prefill every request")
    if num_gpus == 1 and disagg_policy is None:
        policy, prefill = ONE_GPU_DEFAULT
        return Layout(prefill, policy, ONE_GPU_WHY)
    return Layout(1, disagg_policy or "always", "the default: one prefill server")


def without_mps(layout: Layout, reason: str) -> Layout:
    """The default layout once MPS turned out not to be had: colocated (an asked-for one is kept)."""
    if layout.asked or layout.colocated:
        return layout
    return Layout(0, "never", f"MPS cannot be had ({reason}): one colocated server instead of two time-slicing the GPU")
