"""The benchmarks' workload: prompts of random token ids, the same for every backend, and how long
each request's prompt and output are (--length-dist).

Every run draws a fresh prompt set (seeded by --seed and the run's index): a repeated set would
be served from the prefix cache on its second run.

--length-dist fixed (the default): every request has --input-len prompt and --output-len output
tokens. lognormal: each request's prompt and output lengths are drawn independently from lognormal
distributions with medians --input-len and --output-len and sigma --length-sigma (of the underlying
normal), clipped to [1, 4 x the median] (a prompt to at least --prefix-len + 1) and then to the
model's context when it is known (the prompt to context - 1, the output to what is left).
"""

from __future__ import annotations

import argparse
import math
import random
from dataclasses import dataclass

from pdserve.common.config import read_hf_config

LENGTH_DISTS = ("fixed", "lognormal")
CLIP = 4  # a drawn length is at most CLIP x its median


def token_pool(model_path: str) -> list[int]:
    """Ids a prompt may use: below both the model's and the tokenizer's vocab size, not special."""
    from pdserve.common.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model_path)
    hf = read_hf_config(model_path)
    vocab = min(len(tokenizer), int(hf.get("vocab_size") or len(tokenizer)))
    special = set(tokenizer.all_special_ids)
    return [i for i in range(vocab) if i not in special]


def random_prompts(
    pool: list[int],
    num_prompts: int,
    input_len: int,
    seed: int,
    run: int,
    prefix_groups: int = 0,
    prefix_len: int = 0,
    input_lens: list[int] | None = None,
) -> list[list[int]]:
    """Prompts of random ids. With prefix_groups G > 0, each prompt starts with one of G shared
    prefixes of prefix_len ids (drawn afresh per run), the group picked at random per prompt (not
    in turn, which a round-robin router would follow by accident), then random ids to input_len.
    input_lens: each prompt's own length instead of input_len (each > prefix_len)."""
    rng = random.Random(f"{seed}:{run}")  # a str seed is hashed deterministically (not per process)
    lens = [input_len] * num_prompts if input_lens is None else input_lens
    if prefix_groups <= 0:
        return [[rng.choice(pool) for _ in range(n)] for n in lens]
    prefixes = [[rng.choice(pool) for _ in range(prefix_len)] for _ in range(prefix_groups)]
    return [rng.choice(prefixes) + [rng.choice(pool) for _ in range(n - prefix_len)] for n in lens]


@dataclass(frozen=True)
class Lengths:
    """How long each request's prompt and output are: --length-dist with these medians."""

    dist: str
    input_len: int
    output_len: int
    sigma: float = 0.8
    min_input: int = 1  # --prefix-len + 1: a prompt holds its shared prefix and one id more
    context: int | None = None  # the model's context (prompt + output), when known

    def draw(self, num: int, seed: int, run: int) -> tuple[list[int], list[int]]:
        """(prompt lengths, output lengths) of a run's num requests, the same for the same seed and run."""
        if self.dist == "fixed":
            return [self.input_len] * num, [self.output_len] * num
        # NOTE: chat traffic (ShareGPT-like) is right-skewed with a long tail: most requests are
        # short, a few very long. A lognormal has that shape; its median is exp(mu).
        rng = random.Random(f"{seed}:{run}:lengths")  # apart from the prompts' ids: fixed ids stay as they were
        inputs, outputs = [], []
        for _ in range(num):
            p = _clip(rng.lognormvariate(math.log(self.input_len), self.sigma), self.min_input, CLIP * self.input_len)
            o = _clip(rng.lognormvariate(math.log(self.output_len), self.sigma), 1, CLIP * self.output_len)
            if self.context:
                p = min(p, self.context - 1)
                o = min(o, self.context - p)
            inputs.append(p)
            outputs.append(o)
        return inputs, outputs


def _clip(x: float, low: int, high: int) -> int:
    return min(max(round(x), low), high)


@dataclass
class Workload:
    """One run's requests: the prompts, and the output tokens asked of each (ignore_eos)."""

    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def input_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


class Workloads:
    """Each run's workload from --seed, --length-dist and the prefix flags; remembers the lengths
    of the measured runs it drew, for the report."""

    def __init__(self, pool: list[int], args: argparse.Namespace, context: int | None = None):
        if context and args.input_len + args.output_len > context:
            raise ValueError(f"--input-len + --output-len exceeds the context length {context}")
        self.pool, self.seed = pool, args.seed
        self.prefix_groups, self.prefix_len = args.prefix_groups, args.prefix_len
        sigma = args.length_sigma
        self.lengths = Lengths(args.length_dist, args.input_len, args.output_len, sigma, args.prefix_len + 1, context)
        self.drawn: list[tuple[int, int]] = []  # (input tokens, output tokens) of each measured request

    def draw(self, num: int, run: int, record: bool = True, prefixes: bool = True) -> Workload:
        """Run `run`'s num requests; record: count their lengths in the report (a measured run);
        prefixes: with --prefix-groups, the prompts share prefixes (bench serve's warm-up: no)."""
        input_lens, output_lens = self.lengths.draw(num, self.seed, run)
        groups = self.prefix_groups if prefixes else 0
        prompts = random_prompts(
            self.pool, num, self.lengths.input_len, self.seed, run, groups, self.prefix_len, input_lens
        )
        if record:
            self.drawn += zip(input_lens, output_lens)
        return Workload(prompts, output_lens)

    def report(self) -> dict:
        """The distribution, and the mean and most of the lengths drawn (None before any were)."""
        lengths, inputs, outputs = self.lengths, [i for i, _ in self.drawn], [o for _, o in self.drawn]
        return {
            "dist": lengths.dist,
            "sigma": lengths.sigma if lengths.dist != "fixed" else None,
            "input_median": lengths.input_len,
            "output_median": lengths.output_len,
            "context": lengths.context,  # draws are clipped to it (None: unknown, a --base-url server's)
            "mean_input_len": sum(inputs) / len(inputs) if inputs else None,
            "mean_output_len": sum(outputs) / len(outputs) if outputs else None,
            "max_input_len": max(inputs, default=None),
            "max_output_len": max(outputs, default=None),
        }


def describe_workload(count: int, noun: str, lengths: dict) -> str:
    """'128 requests x 256 in -> 64 out', or for lognormal lengths (a Workloads.report()):
    '128 requests, lognormal lengths, medians 256 -> 256, sigma 0.8; mean 312 -> 290'."""
    if lengths["dist"] == "fixed":
        return f"{count} {noun} x {lengths['input_median']} in -> {lengths['output_median']} out"
    return (
        f"{count} {noun}, {lengths['dist']} lengths, medians {lengths['input_median']} -> "
        f"{lengths['output_median']}, sigma {lengths['sigma']:g}; "
        f"mean {lengths['mean_input_len']:.0f} -> {lengths['mean_output_len']:.0f}"
    )
