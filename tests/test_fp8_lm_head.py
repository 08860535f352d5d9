"""--fp8-lm-head (models/fp8.py Fp8Logits): the logits from a float8 copy of the LM
head, a scale per vocabulary row, the hidden states quantized per token. Checked against the same
rounding done by plain torch casts on the unquantized engine (teacher-forced, bench/teacher_forced.py's
score), alone and with --quantization fp8; the tied embeddings stay in the model's dtype."""

import pytest
import torch
from torch.nn import functional as F

from pdserve.bench.teacher_forced import score
from tests.test_fp8_weights import FP8, PLAN, engine_for, teacher_forced


def fake_quant_rows(weight: torch.Tensor) -> torch.Tensor:
    scale = weight.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12) / 448
    return ((weight.float() / scale).to(FP8).float() * scale).to(weight.dtype)


def fake_quant_tokens(x: torch.Tensor) -> torch.Tensor:
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12) / 448
    return ((x.float() / scale).to(FP8).float() * scale).to(x.dtype)


def reference_engine(path):
    """The unquantized engine whose LM head computes from rows and inputs rounded through float8."""
    engine = engine_for(path)
    head = engine.runner.model.lm_head
    weight = fake_quant_rows(head.weight.detach()[: head.rows])
    head.forward = lambda hidden: F.linear(fake_quant_tokens(hidden), weight)[:, : head.vocab_size]
    return engine


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_the_fp8_lm_head_agrees_as_the_same_rounding_by_plain_casts(arch, tiny_models):
    path = tiny_models(arch)
    base = teacher_forced(engine_for(path))
    engine = engine_for(path, fp8_lm_head=True)
    model = engine.runner.model
    weight, scale = model.lm_head.fp8_logits.weight, model.lm_head.fp8_logits.scale
    assert weight.dtype == FP8 and weight.shape[0] % 16 == 0 and scale.shape == (weight.shape[0],)
    embeddings = model.model.embed_tokens if arch == "llama" else model.transformer.wte
    assert embeddings.weight.dtype == torch.float32  # (CPU's dtype) untouched, also when tied
    ours = teacher_forced(engine)
    reference = teacher_forced(reference_engine(path))
    assert score(PLAN, ours, reference)["agreement"] >= 0.97
    against_float = score(PLAN, ours, base)
    print(f"\n{arch} --fp8-lm-head top-1 vs unquantized: {against_float['agreement']:.2%}")
    assert against_float["max_abs_logprob_diff"] > 1e-4, "the logits are the float head's: not quantized"
    assert against_float["agreement"] >= 0.9


def test_the_fp8_lm_head_composes_with_fp8_linear_layers(tiny_models):
    path = tiny_models("llama")
    both = teacher_forced(engine_for(path, quantization="fp8", fp8_lm_head=True))
    layers = teacher_forced(engine_for(path, quantization="fp8"))
    agreement = score(PLAN, both, layers)
    assert agreement["max_abs_logprob_diff"] > 1e-4 and agreement["agreement"] >= 0.9, agreement
