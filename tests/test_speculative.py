"""Speculative decoding's parts (common/engine/speculative/): the n-gram proposer against a brute-force
search, and the exact verification — a speculative loop over transformers' logits returns, seed for seed
and with penalties, the tokens the plain sampler draws one step at a time. (In the engine's decode path:
test_speculative_engine.py.)"""

import random

import pytest
import torch

from pdserve.common.engine.sampling import SamplingBatchInfo, sample
from pdserve.common.engine.speculative.ngram import NgramIndex, NgramProposer
from pdserve.common.engine.speculative.verify import AtStep, accepted_lengths, verify_rows
from pdserve.common.types import Req, SamplingParams


def brute_force(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The latest earlier occurrence of the longest suffix (max_n down to min_n) and what followed it."""
    for n in range(min(max_n, len(tokens)), min_n - 1, -1):
        suffix = tokens[len(tokens) - n :]
        for end in range(len(tokens) - 1, n - 1, -1):  # latest first; the suffix itself (end == len) excluded
            if tokens[end - n : end] == suffix:
                return tokens[end : min(end + k, len(tokens))]
    return []


def test_ngram_proposals_equal_a_brute_force_search_as_tokens_arrive():
    rng = random.Random(0)
    for trial in range(40):
        min_n, max_n = rng.choice([(1, 1), (1, 3), (2, 4), (3, 3)])
        vocab = rng.choice([2, 3, 5, 20])
        index, tokens = NgramIndex(min_n, max_n), []
        for _ in range(rng.randint(1, 60)):
            new = [rng.randrange(vocab) for _ in range(rng.randint(1, 4))]  # (the accepted tokens of a step)
            index.extend(new)
            tokens += new
            k = rng.randint(1, 6)
            assert index.propose(k) == brute_force(tokens, k, min_n, max_n), (trial, tokens, k)


def test_ngram_proposer_prefers_the_longest_and_latest_match_and_respects_limits():
    proposer = NgramProposer(num_tokens=3, min_n=1, max_n=3)
    proposer.extend("a", [1, 2, 3, 9, 1, 2, 4, 5, 6, 1, 2])
    assert proposer.propose("a") == [4, 5, 6]  # "1 2" ended latest at 6 (the 3-gram "6 1 2" never occurred)
    proposer.extend("a", [4])
    assert proposer.propose("a") == [5, 6, 1]  # "1 2 4" is the longest suffix seen before
    assert proposer.propose("a", limit=1) == [5]  # the request may generate one more token only
    assert proposer.propose("a", limit=0) == [] and proposer.propose("nobody") == []
    proposer.extend("b", [7, 8])
    assert proposer.propose("b") == []  # nothing ever came before
    proposer.free("a")
    assert proposer.propose("a") == []
    with pytest.raises(ValueError):
        NgramIndex(2, 1)


def test_accepted_lengths_stop_at_the_first_mismatch_and_at_the_drafts_end():
    targets = torch.tensor([[5, 6, 7, 8], [5, 0, 7, 8], [1, 2, 3, 4], [9, 9, 9, 9]])
    drafts = torch.tensor([[5, 6, 7], [5, 6, 7], [1, 2, 3], [0, 0, 0]])
    num_drafts = torch.tensor([3, 3, 2, 0])
    assert accepted_lengths(targets, drafts, num_drafts).tolist() == [3, 1, 2, 0]


class _HF:
    """transformers' logits of a tiny model, float64 (sequence lengths must not move a sample)."""

    def __init__(self, path):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float64)
        self.model.eval()
        self.vocab = self.model.config.vocab_size

    def last(self, tokens: list[int], n: int) -> torch.Tensor:
        with torch.no_grad():
            return self.model(torch.tensor([tokens])).logits[0, -n:].float()


def _draw(hf: _HF, rows: list[AtStep], logits: torch.Tensor) -> list[int]:
    info = SamplingBatchInfo.from_reqs(rows, hf.vocab, (2,), "cpu")
    return sample(logits, info).next_token_ids.tolist()


def plain(hf: _HF, req: Req, steps: int) -> list[int]:
    for _ in range(steps):
        [token] = _draw(hf, verify_rows(req, []), hf.last(req.prompt_ids + req.output_ids, 1))
        req.output_ids.append(token)
    return req.output_ids


def speculative(hf: _HF, req: Req, steps: int, propose) -> tuple[list[int], int]:
    """Verify `propose(tokens so far, limit)`'s drafts step after step; the output and the drafts accepted."""
    accepted_total = 0
    while len(req.output_ids) < steps:
        drafts = propose(req.output_ids, steps - len(req.output_ids) - 1)
        rows = verify_rows(req, drafts)
        targets = torch.tensor([_draw(hf, rows, hf.last(req.prompt_ids + req.output_ids + drafts, len(rows)))])
        drafted = torch.tensor([drafts], dtype=torch.int64).reshape(1, len(drafts))
        [accepted] = accepted_lengths(targets, drafted, torch.tensor([len(drafts)]))
        req.output_ids += targets[0, : int(accepted) + 1].tolist()
        accepted_total += int(accepted)
    return req.output_ids, accepted_total


def ngram(prompt: list[int], k: int):
    proposer, seen = NgramProposer(num_tokens=k, min_n=1, max_n=3), [0]
    proposer.extend("r", prompt)

    def propose(output: list[int], limit: int) -> list[int]:
        proposer.extend("r", output[seen[0] :])
        seen[0] = len(output)
        return proposer.propose("r", limit)

    return propose


def oracle(expected: list[int], k: int, seed: int):
    """The true continuation, up to k tokens, with one token in three wrong: every draft position gets
    accepted drafts before it, and every one is rejected sometimes."""
    rng = random.Random(seed)

    def propose(output: list[int], limit: int) -> list[int]:
        drafts = expected[len(output) : len(output) + min(k, limit)]
        return [t if rng.random() < 0.67 else (t + 1) % 512 for t in drafts]

    return propose


PARAMS = [
    dict(temperature=0.0),
    dict(temperature=0.8, top_p=0.9, seed=7),
    dict(temperature=0.0, repetition_penalty=1.5, presence_penalty=1.5, frequency_penalty=1.5),
    dict(temperature=0.6, top_k=20, seed=11, repetition_penalty=1.3, presence_penalty=1.0, frequency_penalty=1.0),
    dict(temperature=0.7, min_new_tokens=12, logit_bias=[(2, 5.0)], seed=5),
]


@pytest.mark.parametrize("params", PARAMS, ids=["greedy", "top_p", "greedy_penalties", "penalties", "min_tokens"])
def test_verified_drafts_give_the_plain_samplers_tokens_seed_for_seed(tiny_models, params):
    """Exactness of the verification, for every temperature: drafts right and wrong at every position
    change how many forwards it takes, never a token (greedy, seeded sampling, penalties that see the
    drafts as output, min_new_tokens and the noise key that count the draft positions)."""
    hf, steps = _HF(tiny_models("llama")), 24
    prompt = [0] + [5, 6, 7, 8, 9] * 6
    p = SamplingParams(max_new_tokens=steps, **params)
    expected = plain(hf, Req("r", prompt, p, seed=p.seed or 3), steps)
    got, accepted = speculative(hf, Req("r", prompt, p, seed=p.seed or 3), steps, oracle(expected, 4, seed=1))
    assert got == expected
    assert accepted >= steps // 3, "too few drafts accepted to exercise the later draft positions"


def test_ngram_drafts_on_a_model_that_repeats_itself_are_accepted_and_change_no_token(tiny_models):
    hf, steps = _HF(tiny_models("llama")), 64
    prompt = [0] + [5, 6, 7, 8, 9] * 6
    p = SamplingParams(max_new_tokens=steps, temperature=0.0)
    expected = plain(hf, Req("r", prompt, p, seed=3), steps)
    got, accepted = speculative(hf, Req("r", prompt, p, seed=3), steps, ngram(prompt, 4))
    assert got == expected and accepted > 0


def test_each_verify_row_samples_as_the_request_would_at_that_step():
    """Row j is the request with drafts[:j] as its last output tokens, at step num_sampled + j: the same
    noise key, penalty counts and min_new_tokens ban as a request that had generated them."""
    p = SamplingParams(
        max_new_tokens=50, temperature=0.7, seed=9, min_new_tokens=6, repetition_penalty=1.2, frequency_penalty=0.5
    )
    req = Req("r", [0, 5, 6], p, seed=9)
    req.output_ids = [7, 8, 7]
    drafts = [8, 9, 9, 4]
    rows = verify_rows(req, drafts)
    assert len(rows) == len(drafts) + 1
    for j, row in enumerate(rows):
        had = Req("r", [0, 5, 6], p, seed=9)
        had.output_ids = [7, 8, 7] + drafts[:j]
        a, b = (SamplingBatchInfo.from_reqs([r], 32, (2,), "cpu") for r in (row, had))
        for field in ("noise_keys", "seen_token_idx", "output_token_idx", "banned_token_idx"):
            x, y = getattr(a, field), getattr(b, field)
            assert (x is None and y is None) or torch.equal(x.sort().values, y.sort().values), (j, field)
    req.pending = 1
    with pytest.raises(ValueError):
        verify_rows(req, drafts)
