"""On-device batched sampling: masks, seeded reproducibility, distribution, penalties, logprobs, no sync."""

import math
import random
import zlib

import pytest
import torch

from pdserve.common.engine.sampling import (
    SamplingBatchInfo,
    _mix32,
    exponential_noise,
    process_logits,
    row_key,
    sample,
    to_token_logprobs,
)
from pdserve.common.types import Req, SamplingParams

EOS = 0
SAMPLED = dict(temperature=0.9, top_k=20, top_p=0.95, min_p=0.01)


def make_req(params: SamplingParams, seed: int = 0, prompt=(1, 2, 3), output=(), rid="r") -> Req:
    req = Req(rid, list(prompt), params, seed)
    req.output_ids = list(output)
    return req


def info_for(reqs, vocab_size, eos=(EOS,)):
    return SamplingBatchInfo.from_reqs(reqs, vocab_size, eos, "cpu")


def draw(reqs, logits, eos=(EOS,)):
    return sample(logits, info_for(reqs, logits.shape[1], eos))


def draws_over_seeds(row_logits, params, seeds):
    """One row of logits sampled once per seed, all in one batch."""
    reqs = [make_req(params, seed=s) for s in seeds]
    return draw(reqs, row_logits.expand(len(reqs), -1).contiguous()).next_token_ids


def test_greedy_rows_take_the_argmax_and_skip_the_sampling_tensors():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    reqs = [make_req(SamplingParams(temperature=0.0), seed=i) for i in range(3)]
    reqs += [make_req(SamplingParams(temperature=1.5, top_k=1), seed=i) for i in range(3)]
    info = info_for(reqs, 50)
    assert info.all_greedy and info.temperatures is None and info.noise_keys is None
    assert torch.equal(sample(logits, info).next_token_ids, logits.argmax(-1))
    ties = torch.tensor([[0.0, 3.0, 1.0, 3.0]])
    assert draw([make_req(SamplingParams(temperature=0.0))], ties).next_token_ids.tolist() == [1]


def test_the_plain_greedy_shortcut_builds_what_the_general_path_builds():
    import dataclasses

    plain = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.5, top_k=1),
        SamplingParams(temperature=0.0, ignore_eos=True),
    ]
    reqs = [make_req(p, seed=i, output=[5] * i) for i, p in enumerate(plain)]
    assert all(p.plain_greedy for p in plain)
    shortcut = info_for(reqs, 50)
    general = SamplingBatchInfo.build(reqs, plain, 50, (EOS,), torch.device("cpu"))
    assert dataclasses.asdict(shortcut) == dataclasses.asdict(general)
    # Anything that needs a tensor leaves the shortcut.
    for params in (
        SamplingParams(temperature=0.0, min_new_tokens=2, max_new_tokens=4),
        SamplingParams(temperature=0.0, logprobs=0),
        SamplingParams(temperature=0.0, repetition_penalty=1.2),
        SamplingParams(temperature=0.5),
    ):
        assert not params.plain_greedy
        info = info_for(reqs + [make_req(params)], 50)
        assert (info.banned_token_idx, info.want_logprobs, info.seen_token_idx, info.temperatures) != (
            None,
            False,
            None,
            None,
        )


@pytest.mark.parametrize("params", [dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)])
def test_masks_that_keep_one_token_give_the_argmax(params):
    row = torch.randn(1, 40, generator=torch.Generator().manual_seed(1))
    tokens = draws_over_seeds(row, SamplingParams(temperature=5.0, **params), range(300))
    assert set(tokens.tolist()) == {int(row.argmax())}


def test_top_k_samples_only_among_the_top_k():
    row = torch.randn(1, 40, generator=torch.Generator().manual_seed(2))
    tokens = draws_over_seeds(row, SamplingParams(top_k=3, temperature=3.0), range(1000))
    assert set(tokens.tolist()) == set(row[0].topk(3).indices.tolist())


def chi_square(tokens: torch.Tensor, expected: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=len(expected)).double()
    want = expected.double() * len(tokens)
    assert not bool((counts[want == 0] > 0).any()), "drew a token that has probability 0"
    keep = want > 0
    return float(((counts[keep] - want[keep]) ** 2 / want[keep]).sum())


@pytest.mark.parametrize(
    "probs, params, expected",
    [
        ([0.5, 0.3, 0.15, 0.05], dict(top_p=0.7), [0.625, 0.375, 0, 0]),
        ([0.5, 0.3, 0.15, 0.05], dict(min_p=0.5), [0.625, 0.375, 0, 0]),
        # top_k=3 renormalizes to [.444, .333, .222], so top_p=0.75 keeps {0, 1}; on the raw
        # probabilities (mass before token 2 = 0.7) it would keep token 2 too.
        ([0.4, 0.3, 0.2, 0.1], dict(top_k=3, top_p=0.75), [4 / 7, 3 / 7, 0, 0]),
    ],
)
def test_top_p_min_p_and_top_k_then_top_p_keep_the_expected_sets(probs, params, expected):
    tokens = draws_over_seeds(torch.tensor([probs]).log(), SamplingParams(**params), range(4000))
    assert chi_square(tokens, torch.tensor(expected)) < 15  # 1 degree of freedom: p = 1e-4 at 15


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_the_empirical_distribution_matches_the_softmax(temperature):
    row = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, 1.5]])
    tokens = draws_over_seeds(row, SamplingParams(temperature=temperature), range(20000))
    # 7 degrees of freedom: p = 0.001 at 24.3. The seeds are fixed, so this cannot flake.
    assert chi_square(tokens, torch.softmax(row[0] / temperature, -1)) < 24.3


def step_logits(rid: str, step: int, vocab_size: int = 64) -> torch.Tensor:
    """Logits that depend only on (request, step), as a model's would."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{rid}/{step}".encode()))
    return torch.randn(vocab_size, generator=gen) * 2


def generate(reqs: list[Req], steps: int) -> dict[str, list[int]]:
    """Samples `steps` tokens for the batch; returns rid -> output ids."""
    for step in range(steps):
        logits = torch.stack([step_logits(r.rid, step) for r in reqs])
        for req, token in zip(reqs, draw(reqs, logits).next_token_ids.tolist()):
            req.output_ids.append(token)
    return {r.rid: r.output_ids for r in reqs}


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch():
    target = dict(rid="target", params=SamplingParams(**SAMPLED), seed=7)
    alone = generate([make_req(**target)], 20)["target"]
    assert generate([make_req(**target)], 20)["target"] == alone
    others = [
        dict(rid="greedy", params=SamplingParams(temperature=0.0), seed=1),
        dict(rid="penalized", params=SamplingParams(repetition_penalty=1.3, frequency_penalty=0.5), seed=2),
        dict(rid="min-tokens", params=SamplingParams(min_new_tokens=5, logprobs=2, top_p=0.5), seed=3),
        dict(rid="same-seed-other-params", params=SamplingParams(temperature=1.3), seed=7),
    ]
    for order_seed in range(3):
        batch = [make_req(**r) for r in others + [target]]
        random.Random(order_seed).shuffle(batch)
        assert generate(batch, 20)["target"] == alone


def test_different_seeds_give_different_draws():
    # one rid, so every request sees the same logits: only the seed tells them apart
    reqs = [make_req(SamplingParams(**SAMPLED), seed=s, rid="same") for s in range(20)]
    generate(reqs, 10)
    assert len({tuple(r.output_ids) for r in reqs}) == 20


def test_seeds_are_taken_modulo_2_to_the_64():
    row = torch.randn(1, 64, generator=torch.Generator().manual_seed(3))
    tokens = draws_over_seeds(row, SamplingParams(), [-1, 2**64 - 1, -(2**63), 2**63]).tolist()
    assert tokens[0] == tokens[1] and tokens[2] == tokens[3]


def test_noise_matches_a_pure_python_reference():
    seeds = [0, 1, 2**32, 2**63 - 1, -(2**63), 2**64 - 1, 123456789012345]
    keys = [row_key(seed, step) for seed in seeds for step in (0, 1, 2**20)]
    assert all(0 <= k < 2**32 for k in keys)
    vocab = 300
    q = exponential_noise(torch.tensor(keys)[:, None], vocab)
    u = [[max(_mix32(_mix32(t ^ 0x27D4EB2F) ^ k) >> 8, 1) / 2**24 for t in range(vocab)] for k in keys]
    assert torch.equal(q, -torch.log(torch.tensor(u, dtype=torch.float32)))


def test_noise_is_exponential_and_unrelated_across_steps():
    steps = 256
    q = exponential_noise(torch.tensor([[row_key(0, s)] for s in range(steps)]), steps)
    assert bool((q > 0).all()) and float(q.max()) <= 24 * math.log(2) + 1e-4  # u never 0 or 1
    assert abs(float(q.double().mean()) - 1.0) < 0.01  # Exp(1): mean 1, std 1 / 256 here
    # seed 0, step s, token t vs step t, token s: a symmetric hash would make these equal
    assert int((q == q.T).sum()) <= steps + 2
    assert len({tuple(sorted(r)) for r in q.tolist()}) == steps  # no step's noise is another's permuted


def test_draws_are_independent_across_steps_and_adjacent_seeds():
    n, vocab = 8000, 4
    reqs = [make_req(SamplingParams(), seed=s) for s in range(n)]
    uniform = torch.zeros(n, vocab)
    first = draw(reqs, uniform).next_token_ids
    for req in reqs:
        req.output_ids.append(0)
    second = draw(reqs, uniform).next_token_ids
    cells = torch.full((vocab * vocab,), 1 / vocab**2)
    # 15 degrees of freedom: p = 0.001 at 37.7
    assert chi_square(first * vocab + second, cells) < 37.7  # same seed, consecutive steps
    assert chi_square(first[:-1] * vocab + first[1:], cells) < 37.7  # seeds s and s + 1, same step


def test_penalties_match_a_hand_computed_example():
    logits = torch.tensor([[1.0, 2.0, -1.0, 4.0, 0.5, -2.0]] * 2)
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    penalized = make_req(params, prompt=[1, 2], output=[2, 3, 3])
    plain = make_req(SamplingParams(), prompt=[1, 2], output=[2, 3, 3])
    out = process_logits(logits, info_for([plain, penalized], 6))
    # repetition over {1, 2, 3}: 2/2, -1*2, 4/2; then counts {2: 1, 3: 2}: -2 - 0.5 - 0.25, 2 - 1 - 0.25
    assert out[1].tolist() == [1.0, 1.0, -2.75, 0.75, 0.5, -2.0]
    assert torch.equal(out[0], logits[0])
    info = info_for([plain], 6)  # no penalties, no work
    assert info.seen_token_idx is None and info.output_token_idx is None and info.banned_token_idx is None


def test_a_repetition_penalty_below_float32s_range_never_samples_a_masked_token():
    """repetition_penalty 1e-263 is 0 in float32: a seen token's positive logit becomes +inf, and two of
    them made softmax NaN, whose argmax is token 0, even where the grammar mask forbids it (the API
    fuzzer's case). The +inf tokens now share the draw, among the tokens the mask allows."""
    logits = torch.tensor([[0.5, 3.0, 2.0, 1.0, -1.0, 0.2, 0.1, 0.3]] * 8)
    params = SamplingParams(repetition_penalty=1e-263, temperature=0.5, seed=1)
    reqs = [make_req(params, seed=s, prompt=[1, 2, 3], output=[]) for s in range(8)]
    allowed = [1, 2, 5]  # token 0 is not
    mask = torch.tensor([[sum(1 << t for t in allowed)]] * 8, dtype=torch.int32)  # bit t: token t
    out = sample(logits, info_for(reqs, 8), grammar_mask=mask).next_token_ids.tolist()
    assert set(out) <= {1, 2}, out  # the two seen, allowed tokens whose logits went to +inf


def test_min_new_tokens_masks_eos_and_stop_ids():
    logits = torch.full((1, 16), -5.0)
    logits[0, EOS], logits[0, 5], logits[0, 9] = 10.0, 9.0, 1.0
    for params in (
        SamplingParams(min_new_tokens=2, temperature=0.0, stop_token_ids=(5, 1000)),
        SamplingParams(min_new_tokens=2, stop_token_ids=(5,), ignore_eos=True),
    ):
        for output in ([], [9]):
            reqs = [make_req(params, seed=s, output=output) for s in range(50)]
            tokens = draw(reqs, logits.expand(50, -1).contiguous()).next_token_ids
            assert not set(tokens.tolist()) & {EOS, 5}
        done = make_req(params, output=[9, 9])
        assert draw([done], logits).next_token_ids.tolist() in ([EOS], [5])


def test_logprobs_are_of_the_raw_logits_and_honor_each_request():
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(4))
    reqs = [
        make_req(SamplingParams(temperature=0.0, logprobs=3)),
        make_req(SamplingParams(logprobs=0, repetition_penalty=1.5), seed=1),
        make_req(SamplingParams(temperature=0.7, top_k=5)),
        make_req(SamplingParams(top_p=0.9, logprobs=5), seed=2),
    ]
    out = draw(reqs, logits)
    raw = torch.log_softmax(logits, -1)
    tokens = out.next_token_ids
    assert torch.equal(out.logprobs, raw.gather(1, tokens[:, None]).squeeze(1))
    assert out.top_logprob_ids.shape == (4, 5)
    assert torch.equal(out.top_logprobs, raw.topk(5).values)
    lps = to_token_logprobs(out, reqs)
    assert lps[2] is None and lps[1].top == [] and len(lps[0].top) == 3 and len(lps[3].top) == 5
    for row in (0, 1, 3):
        assert lps[row].token_id == tokens[row] and lps[row].logprob == pytest.approx(float(raw[row, tokens[row]]))
        values = [v for _, v in lps[row].top]
        assert values == sorted(values, reverse=True)
    assert lps[0].top[0][0] == lps[0].token_id  # greedy: the sampled token is the top one
    out = draw(reqs[2:3], logits[2:3])  # nobody asked: nothing computed
    assert out.logprobs is None and out.top_logprob_ids is None and to_token_logprobs(out, reqs[2:3]) == [None]


def mixed_batch():
    return [
        make_req(SamplingParams(temperature=0.0, logprobs=2)),
        make_req(SamplingParams(**SAMPLED, repetition_penalty=1.2, presence_penalty=0.3), seed=5, output=[4, 4]),
        make_req(SamplingParams(min_new_tokens=3, stop_token_ids=(7,), logprobs=0), seed=6),
        make_req(SamplingParams(temperature=1.1, top_k=8), seed=2**64 - 1, output=[1]),
    ]


def test_sample_never_reads_device_values(monkeypatch):
    """On CPU there is no sync to catch, so forbid every way a tensor's value reaches Python."""
    reqs, logits = mixed_batch(), torch.randn(4, 100)

    def forbidden(*args, **kwargs):
        raise AssertionError("sample() read a tensor value on the host")

    def no_mask_indexing(original):
        def indexed(self, index, *value):
            parts = index if isinstance(index, tuple) else (index,)
            if any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts):
                raise AssertionError("boolean-mask indexing has a data-dependent shape")
            return original(self, index, *value)

        return indexed

    for name in ("item", "tolist", "cpu", "numpy", "nonzero", "__bool__", "__int__", "__float__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    for name in ("__getitem__", "__setitem__"):
        monkeypatch.setattr(torch.Tensor, name, no_mask_indexing(getattr(torch.Tensor, name)))
    monkeypatch.setattr(torch, "masked_select", forbidden)
    out = sample(logits, info_for(reqs, 100))
    monkeypatch.undo()
    assert out.next_token_ids.shape == (4,)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_no_host_sync_on_cuda():
    reqs, logits = mixed_batch(), torch.randn(4, 1000)
    expected = draw(reqs, logits)
    on_device = logits.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = sample(on_device, SamplingBatchInfo.from_reqs(reqs, 1000, (EOS,), "cuda"))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(out.next_token_ids.cpu(), expected.next_token_ids)
    assert torch.allclose(out.logprobs.cpu(), expected.logprobs, atol=1e-5)
