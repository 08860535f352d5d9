"""Prompt logprobs (SamplingParams.prompt_logprobs) and max_new_tokens 0 in the colocated engine:
each prompt token's log-softmax given the tokens before it equals transformers' (fp32), whatever
the batch, the chunking, the prefix cache or the loop; requests that do not ask are unchanged."""

import pytest
import torch

from pdserve.common.types import FinishReason, SamplingParams

ARCHS = ["llama", "gpt2", "qwen3"]


def hf_prompt_logprobs(path: str, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Per prompt: [n, vocab] log-softmax of transformers' logits at every position (fp32)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32).eval()
    with torch.no_grad():
        return [torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1) for ids in prompts]


def prompts_for(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (1, 2, 9, 37, 70)]


def check(completion, ids: list[int], reference: torch.Tensor, top_n: int) -> None:
    got = completion.prompt_logprobs
    assert got is not None and len(got) == len(ids) and got[0] is None
    for p in range(1, len(ids)):
        lp, row = got[p], reference[p - 1]
        assert lp.token_id == ids[p]
        assert abs(lp.logprob - row[ids[p]].item()) < 1e-4, (p, lp.logprob, row[ids[p]].item())
        assert lp.rank == 1 + int((row > row[ids[p]]).sum())
        assert len(lp.top) == top_n
        if top_n:
            values, top_ids = row.topk(top_n)
            assert [t for t, _ in lp.top][:1] == top_ids.tolist()[:1]
            assert torch.allclose(torch.tensor([v for _, v in lp.top]), values, atol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_prompt_logprobs_equal_transformers(make_engine, tiny_models, arch):
    engine = make_engine(arch)
    prompts = prompts_for(engine.runner.vocab_size)
    reference = hf_prompt_logprobs(tiny_models(arch), prompts)
    params = [SamplingParams(max_new_tokens=3, temperature=0, prompt_logprobs=k) for k in (0, 1, 5, 0, 2)]
    outs = engine.generate(prompts, params)
    for out, ids, ref, p in zip(outs, prompts, reference, params):
        check(out, ids, ref, p.prompt_logprobs)
        # The first generated token is the argmax after the whole prompt, as without prompt logprobs.
        assert len(out.output_ids) == 3


# Scheduling paths a scored prompt must survive: chunks (positions spread over batches), a prompt
# already in the prefix cache (which must not skip its scores), the serial loop, tiny pages.
MODES = {
    "chunked": dict(chunked_prefill_size=16, page_size=4),
    "serial_chunked": dict(chunked_prefill_size=8, disable_overlap_schedule=True),
    "small_batch_budget": dict(max_prefill_tokens=24, chunked_prefill_size=24, page_size=1),
}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_prompt_logprobs_in_every_scheduling_mode(make_engine, tiny_models, mode):
    engine = make_engine("llama", **MODES[mode])
    prompts = prompts_for(engine.runner.vocab_size)
    reference = hf_prompt_logprobs(tiny_models("llama"), prompts)
    plain = SamplingParams(max_new_tokens=4, temperature=0)
    before = engine.generate(prompts, [plain] * len(prompts))  # now every prompt is in the prefix cache
    # Mixed batch: scored and plain requests together; the plain ones' outputs are unchanged.
    params = [
        SamplingParams(max_new_tokens=4, temperature=0, prompt_logprobs=3) if i % 2 == 0 else plain
        for i in range(len(prompts))
    ]
    outs = engine.generate(prompts, params)
    for i, (out, ids, ref) in enumerate(zip(outs, prompts, reference)):
        assert out.output_ids == before[i].output_ids
        if i % 2 == 0:
            check(out, ids, ref, 3)
            assert out.cached_tokens == 0, "a scored prompt is computed whole"
        else:
            assert out.prompt_logprobs is None


def test_max_tokens_zero_computes_only_the_prompt(make_engine, tiny_models):
    engine = make_engine("llama")
    prompts = prompts_for(engine.runner.vocab_size)
    reference = hf_prompt_logprobs(tiny_models("llama"), prompts)
    outs = engine.generate(prompts, [SamplingParams(max_new_tokens=0, prompt_logprobs=1)] * len(prompts))
    for out, ids, ref in zip(outs, prompts, reference):
        assert out.output_ids == [] and out.text == "" and out.finish_reason is FinishReason.LENGTH
        check(out, ids, ref, 1)


def test_bad_prompt_logprobs_are_refused():
    for bad in (-1, 21, 1.5, "3"):
        with pytest.raises(ValueError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_new_tokens=-1)
