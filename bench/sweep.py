"""`pdserve bench serve --stacks ...`: one request-rate sweep per local stack configuration, in one
command, with SLO attainment, goodput and a plot (the study of when disaggregation wins: docs/disaggregation.md).

    pdserve bench serve --random-weights llama/1b --input-len 4096 --output-len 128 \\
        --request-rate 1 2 4 8 --goodput ttft:500 tpot:40 \\
        --stacks 1p1d=1:1:always replicas=0:2:never auto=1:1:auto --plot goodput.png

A stack is NAME=PREFILL:DECODE:POLICY[:P/D]: that many prefill and decode servers (placed on the GPUs
as `pdserve up` places them; servers sharing a GPU under MPS with SM shares P% and D%, default
--sm-shares) behind a router with that --disagg-policy. Every stack runs every rate on
the same prompts. SLO attainment is the fraction of a run's requests that succeeded and met every
--goodput SLO (DistServe's measure); a stack's goodput is the highest rate whose attainment is at
least --attainment (0.9), as DistServe defines it: the rate it sustains within the SLOs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pdserve.router.disagg import POLICIES
from pdserve.router.gpu_sharing import SMShares, parse_sm_shares


@dataclass(frozen=True)
class StackSpec:
    name: str
    num_prefill: int
    num_decode: int
    disagg_policy: str
    sm_shares: SMShares | None = None  # servers sharing a GPU: each role's SM percent (None: --sm-shares)


def parse_stack(spec: str) -> StackSpec:
    """NAME=PREFILL:DECODE:POLICY[:P/D] -> StackSpec; ValueError naming what is wrong."""
    name, sep, rest = spec.partition("=")
    parts = rest.split(":")
    if not sep or not name or len(parts) not in (3, 4) or not parts[0].isdigit() or not parts[1].isdigit():
        raise ValueError(f"--stacks takes NAME=PREFILL:DECODE:POLICY[:P/D] (e.g. 1p1d=1:1:always), got {spec!r}")
    shares = parse_sm_shares(parts[3].replace("/", ":")) if len(parts) == 4 else None
    stack = StackSpec(name, int(parts[0]), int(parts[1]), parts[2], shares)
    if stack.disagg_policy not in POLICIES:
        raise ValueError(f"--stacks {spec!r}: the policy must be always, never or auto")
    if stack.num_decode < 1 or (stack.num_prefill < 1 and stack.disagg_policy != "never"):
        raise ValueError(f"--stacks {spec!r}: needs a decode server, and a prefill server unless the policy is never")
    return stack


def goodput_rate(runs: list[dict], target: float) -> float | None:
    """The highest request rate whose SLO attainment is at least `target` (None: no run reached it).
    All-at-once runs (rate inf) are no rate to sustain: they do not count."""
    rates = [
        float(run["request_rate"])
        for run in runs
        if math.isfinite(float(run["request_rate"]))
        and run.get("slo_attainment") is not None
        and run["slo_attainment"] >= target
    ]
    return max(rates) if rates else None


def plot_sweep(
    stacks: dict[str, list[dict]], goodputs: dict[str, float | None], target: float, title: str, path: str
) -> None:
    """A PNG of SLO attainment, p90 TTFT and p90 TPOT against the request rate, one line per stack."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    panels = (
        ("slo_attainment", "SLO attainment", None),
        ("ttft_ms", "p90 TTFT (ms)", "p90"),
        ("tpot_ms", "p90 TPOT (ms)", "p90"),
    )
    for name, runs in stacks.items():
        points = sorted((float(run["request_rate"]), run) for run in runs if math.isfinite(float(run["request_rate"])))
        rates = [rate for rate, _ in points]
        goodput = goodputs.get(name)
        label = f"{name} (goodput {goodput:g} req/s)" if goodput is not None else f"{name} (no rate meets the SLOs)"
        for ax, (key, _, stat) in zip(axes, panels):
            values = [run[key][stat] if stat else run[key] for _, run in points]
            ax.plot(rates, values, marker="o", label=label)
    for ax, (_, ylabel, _) in zip(axes, panels):
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
    axes[0].axhline(target, color="grey", linestyle="--", linewidth=1)
    axes[0].set_ylim(0, 1.05)
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
