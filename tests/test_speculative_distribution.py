"""Sampled speculative decoding keeps the target's distribution: many seeded requests through a speculating
engine (the target as its own draft model, whose greedy drafts a sample keeps about as often as the
argmax is drawn), their tokens after the prompt tested against transformers' probabilities with a
chi-square test per prefix (fixed seeds, so the test is deterministic). The seed-for-seed equality with
the plain engine is tests/test_speculative_engine.py's; this checks that both draw from the model."""

import math
from collections import Counter, defaultdict

import torch
from transformers import AutoModelForCausalLM

from pdserve.common.types import SamplingParams

PROMPT = [0] + [5, 6, 7, 8, 9] * 6
TOP_K = 4
REQUESTS = 1500


def chi2_critical(df: int, z: float = 3.719) -> float:
    """The chi-square quantile at the normal quantile z (3.719: p = 1e-4), Wilson and Hilferty's cube."""
    c = 2 / (9 * df)
    return df * (1 - c + z * math.sqrt(c)) ** 3


def top_k_probs(model, prefix: list[int]) -> dict[int, float]:
    """The next token's distribution under temperature 1 and top_k = TOP_K (fp32, transformers)."""
    with torch.no_grad():
        logits = model(torch.tensor([prefix])).logits[0, -1].double()
    values, ids = logits.topk(TOP_K)
    return dict(zip(ids.tolist(), torch.softmax(values, dim=-1).tolist()))


def chi2(counts: Counter, probs: dict[int, float]) -> tuple[float, int]:
    """Pearson's statistic and degrees of freedom; cells expected below 5 pooled into one."""
    n = sum(counts.values())
    assert set(counts) <= set(probs), (counts, probs)  # (never a token outside the top k)
    cells, rest_seen, rest_p = [], 0, 0.0
    for token, p in probs.items():
        if n * p >= 5:
            cells.append((counts[token], n * p))
        else:
            rest_seen, rest_p = rest_seen + counts[token], rest_p + p
    if rest_p > 0:
        cells.append((rest_seen, n * rest_p))
    return sum((seen - expected) ** 2 / expected for seen, expected in cells), len(cells) - 1


def test_sampled_tokens_follow_the_targets_distribution(make_engine, tiny_models):
    path = tiny_models("llama")
    engine = make_engine(
        "llama",
        speculative="draft",
        draft_model_path=path,
        speculative_overlap="on",
        speculative_max_batch=0,  # (every step speculates, at any batch)
        max_running_requests=64,
        page_size=4,
    )
    sampled = dict(max_new_tokens=3, temperature=1.0, top_k=TOP_K, ignore_eos=True)
    params = [SamplingParams(seed=seed, **sampled) for seed in range(REQUESTS)]
    outputs = [c.output_ids for c in engine.generate([PROMPT] * REQUESTS, params)]
    stats = engine.scheduler.stats
    # The second and third tokens come from verify steps, the third often from an accepted draft's row
    assert stats["spec_verify_steps"] > 0 and stats["spec_accepted_tokens"] > REQUESTS // 5, stats
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    total, df = 0.0, 0
    for position in range(3):
        groups: dict[tuple[int, ...], Counter] = defaultdict(Counter)
        for tokens in outputs:
            groups[tuple(tokens[:position])][tokens[position]] += 1
        for prefix, counts in groups.items():
            if sum(counts.values()) < 50:  # (too few to test; the others hold nearly all requests)
                continue
            statistic, cells = chi2(counts, top_k_probs(model, PROMPT + list(prefix)))
            total, df = total + statistic, df + cells
    assert df >= 12, df
    assert total < chi2_critical(df), (total, df)
