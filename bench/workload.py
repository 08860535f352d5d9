"""The benchmarks' workload: prompts of random token ids, the same for every backend.

Every run draws a fresh prompt set (seeded by --seed and the run's index): a repeated set would
be served from the prefix cache on its second run.
"""

from __future__ import annotations

import random

from pdserve.common.config import read_hf_config


def token_pool(model_path: str) -> list[int]:
    """Ids a prompt may use: below both the model's and the tokenizer's vocab size, not special."""
    from pdserve.common.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model_path)
    hf = read_hf_config(model_path)
    vocab = min(len(tokenizer), int(hf.get("vocab_size") or len(tokenizer)))
    special = set(tokenizer.all_special_ids)
    return [i for i in range(vocab) if i not in special]


def random_prompts(
    pool: list[int], num_prompts: int, input_len: int, seed: int, run: int, prefix_groups: int = 0, prefix_len: int = 0
) -> list[list[int]]:
    """Prompts of random ids. With prefix_groups G > 0, each prompt starts with one of G shared
    prefixes of prefix_len ids (drawn afresh per run), the group picked at random per prompt (not
    in turn, which a round-robin router would follow by accident), then random ids to input_len."""
    rng = random.Random(f"{seed}:{run}")  # a str seed is hashed deterministically (not per process)
    if prefix_groups <= 0:
        return [[rng.choice(pool) for _ in range(input_len)] for _ in range(num_prompts)]
    prefixes = [[rng.choice(pool) for _ in range(prefix_len)] for _ in range(prefix_groups)]
    return [
        rng.choice(prefixes) + [rng.choice(pool) for _ in range(input_len - prefix_len)] for _ in range(num_prompts)
    ]
