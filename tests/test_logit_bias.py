"""logit_bias on the device: added to the logits before sampling (after penalties, before
min_tokens' masking), in the colocated engine; the router's wire carries it (tests/test_router.py)."""

import torch

from pdserve.common.types import SamplingParams


def test_logit_bias_forces_and_forbids_tokens(make_engine):
    engine = make_engine("llama")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, engine.runner.vocab_size, (n,), generator=g).tolist() for n in (5, 17, 40)]
    plain = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)
    base = engine.generate(prompts, [plain] * 3)
    forced = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True, logit_bias=((7, 100.0),))
    first = base[1].output_ids[0]
    banned = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True, logit_bias=((first, -100.0),))
    sampled = SamplingParams(max_new_tokens=6, temperature=1.0, seed=3, ignore_eos=True, logit_bias=((9, 100.0),))
    outs = engine.generate(prompts, [forced, banned, plain])
    assert outs[0].output_ids == [7] * 6
    assert outs[1].output_ids[0] != first and first not in outs[1].output_ids
    assert outs[2].output_ids == base[2].output_ids, "a request without a bias in the same batch is unchanged"
    assert engine.generate([prompts[0]], [sampled])[0].output_ids == [9] * 6, "sampled rows too"


def test_logprobs_stay_those_of_the_raw_distribution(make_engine):
    engine = make_engine("llama")
    prompt = [1, 2, 3, 4, 5]
    raw = engine.generate([prompt], [SamplingParams(max_new_tokens=1, temperature=0, logprobs=0)])[0]
    token = raw.output_ids[0]
    other = (token + 1) % engine.runner.vocab_size
    biased = engine.generate(
        [prompt], [SamplingParams(max_new_tokens=1, temperature=0, logprobs=0, logit_bias=((other, 100.0),))]
    )[0]
    assert biased.output_ids == [other]
    assert biased.logprobs[0].logprob < raw.logprobs[0].logprob  # `other` was not the model's choice
