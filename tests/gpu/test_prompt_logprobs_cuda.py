"""Prompt logprobs and GGUF checkpoints on CUDA: the scoring forward runs eagerly beside CUDA-graph
batches (prefill graphs and decode graphs stay on for everyone else), fp32 equal to transformers."""

import random

import pytest
import torch

from pdserve.common.engine.engine import Engine
from pdserve.common.types import SamplingParams
from tests.test_prompt_logprobs import check


def prompts(n, vocab=512, seed=3):
    rng = random.Random(seed)
    return [[0] + [rng.randrange(5, vocab) for _ in range(rng.randrange(1, 300))] for _ in range(n)]


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_prompt_logprobs_on_cuda_with_graphs_equal_transformers(arch, tiny_models):
    path = tiny_models(arch)
    cases = prompts(12)
    engine = Engine(model_path=path, device="cuda", dtype="float32", max_total_tokens=16384, chunked_prefill_size=128)
    assert engine.runner.cuda_graphs is not None and engine.runner.prefill_graphs is not None
    plain = SamplingParams(max_new_tokens=8, temperature=0)
    before = [c.output_ids for c in engine.generate(cases, [plain] * len(cases))]
    params = [
        SamplingParams(max_new_tokens=8, temperature=0, prompt_logprobs=4) if i % 3 == 0 else plain
        for i in range(len(cases))
    ]
    outs = engine.generate(cases, params)
    assert [c.output_ids for c in outs] == before, "scoring some prompts changes nobody's tokens"
    reference = hf_prompt_logprobs_cuda(path, [cases[i] for i in range(0, len(cases), 3)])
    for out, ids, ref in zip(outs[::3], cases[::3], reference):
        check(out, ids, ref.cpu(), 4)
    assert engine.is_idle()


def hf_prompt_logprobs_cuda(path, prompts_):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32).to("cuda").eval()
    with torch.no_grad():
        return [torch.log_softmax(hf(torch.tensor([ids], device="cuda")).logits[0].float(), dim=-1) for ids in prompts_]


def test_a_gguf_checkpoint_on_cuda_in_bf16(tiny_models, tmp_path):
    """A Q8_0 GGUF served in bf16 with the fast path: the same tokens as its dequantized fp32 weights
    on the first step for most prompts (bf16 is not exact), every request ends, KV idle."""
    import gguf as gguf_package

    from tests.tiny_gguf import write_gguf

    gguf = write_gguf(tiny_models("llama"), tmp_path / "tiny.gguf", gguf_package.GGMLQuantizationType.Q8_0)
    cases = prompts(16, seed=5)
    params = SamplingParams(max_new_tokens=8, temperature=0)
    fp32 = Engine(model_path=str(gguf), device="cuda", dtype="float32", max_total_tokens=8192).generate(cases, params)
    engine = Engine(model_path=str(gguf), device="cuda", dtype="bfloat16", max_total_tokens=8192)
    bf16 = engine.generate(cases, params)
    first = sum(a.output_ids[:1] == b.output_ids[:1] for a, b in zip(fp32, bf16)) / len(cases)
    assert first >= 0.75 and all(len(c.output_ids) == 8 for c in bf16)
    assert engine.is_idle()
