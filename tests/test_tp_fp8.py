"""FP8 weights and the FP8 KV cache with tensor parallelism on CPU (gloo, tp = 2).

The yardstick is the tp = 1 engine with the same FP8 settings. The weights each rank holds are exactly
the tp = 1 model's rows or columns (their scales split with the rows, or whole), and the FP8 KV cache's
scales are tp = 1's, so with FP8 KV alone a tp = 2 engine gives tp = 1's greedy tokens. FP8 weights are
quantized per token over the features a rank holds, so tp = 2 and tp = 1 are two quantizations of one
model: each is held to the unquantized model's answers alike (teacher-forced top-1 agreement).
"""

import pytest
import torch

from pdserve.bench.teacher_forced import score
from pdserve.common.engine.engine import Engine
from pdserve.common.engine.models.fp8 import Fp8Linear
from pdserve.common.engine.models.loader import load_model
from pdserve.common.engine.tp import TPGroup
from pdserve.common.types import SamplingParams
from tests.test_fp8_weights import PLAN, PROMPTS, teacher_forced, write_fp8_checkpoint
from tests.test_tp import engines_ending_idle

ENGINE = dict(device="cpu", max_total_tokens=4096, chunked_prefill_size=32, page_size=4, max_running_requests=8)
GREEDY = [SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)] * 4


@pytest.fixture
def tp_engines():
    yield from engines_ending_idle(ENGINE)


@pytest.mark.parametrize("form", ["compressed-tensors channel", "compressed-tensors tensor"])
def test_each_rank_holds_its_rows_or_columns_of_the_fp8_weights_and_their_scales(form, tiny_models, tmp_path):
    path = tmp_path / "fp8"
    write_fp8_checkpoint(tiny_models("llama"), path, form)
    whole = dict(load_model(str(path), torch.float32, "cpu").named_modules())
    rank1 = dict(load_model(str(path), torch.float32, "cpu", TPGroup(1, 2, torch.device("cpu"))).named_modules())
    layer = "model.layers.1"
    for name, rows in (("self_attn.q_proj", slice(32, 64)), ("mlp.gate_proj", slice(64, 128))):
        ours, full = rank1[f"{layer}.{name}"], whole[f"{layer}.{name}"]
        assert isinstance(ours, Fp8Linear) and ours.tp is None
        assert torch.equal(ours.weight.view(torch.uint8), full.weight[rows].view(torch.uint8))
        assert torch.equal(ours.weight_scale, full.weight_scale[rows])
    for name, cols in (("self_attn.o_proj", slice(32, 64)), ("mlp.down_proj", slice(64, 128))):
        ours, full = rank1[f"{layer}.{name}"], whole[f"{layer}.{name}"]
        assert isinstance(ours, Fp8Linear) and ours.tp.size == 2, "a row-parallel layer all-reduces"
        assert torch.equal(ours.weight.view(torch.uint8), full.weight[:, cols].contiguous().view(torch.uint8))
        assert torch.equal(ours.weight_scale, full.weight_scale), "every row's scale, whole"


def test_fp8_kv_at_tp2_scales_every_layer_as_tp1_and_gives_its_greedy_tokens(tiny_models, tp_engines):
    path = tiny_models("llama")
    single = tp_engines(path, kv_cache_dtype="fp8_e4m3")
    engine = tp_engines(path, kv_cache_dtype="fp8_e4m3", tp_size=2)
    # Calibrated on each rank's own heads, then the largest taken: tp = 1's scales.
    ours, theirs = engine.runner.kv_pool, single.runner.kv_pool
    assert ours.quantized and torch.allclose(ours.k_scales, theirs.k_scales, rtol=1e-5)
    assert torch.allclose(ours.v_scales, theirs.v_scales, rtol=1e-5)
    prompts = PROMPTS[:4]
    expected = [o.output_ids for o in single.generate(prompts, GREEDY)]
    assert [o.output_ids for o in engine.generate(prompts, GREEDY)] == expected
    # Again, from the radix cache (FP8 pages reused on both ranks).
    assert [o.output_ids for o in engine.generate(prompts, GREEDY)] == expected
    assert engine.scheduler.stats["cache_hit_tokens"] > 0


def agrees_like_tp1(engine: Engine, single: Engine, unquantized: Engine) -> None:
    """tp = 2's FP8 answers are as close to the unquantized model's as tp = 1's (teacher-forced top-1).

    NOTE not tp = 1's tokens: a row-parallel input's per-token scales are each rank's own (models/fp8.py),
    a second quantization of the same weights. On these tiny random models FP8 itself is coarse (tp = 1
    agrees with the unquantized model at ~70% of positions) and tp = 2 with tp = 1 at ~85%."""
    base = teacher_forced(unquantized)
    tp1, tp2 = score(PLAN, teacher_forced(single), base), score(PLAN, teacher_forced(engine), base)
    print(f"\ntop-1 agreement with the unquantized model: tp 1 {tp1['agreement']:.2%}, tp 2 {tp2['agreement']:.2%}")
    assert tp2["agreement"] >= tp1["agreement"] - 0.05
    assert tp2["max_abs_logprob_diff"] > 1e-2, "the unquantized logprobs: quantization skipped"


def test_an_fp8_checkpoint_with_fp8_kv_at_tp2_agrees_like_tp1(tiny_models, tmp_path, tp_engines):
    path = tmp_path / "fp8"
    write_fp8_checkpoint(tiny_models("llama"), path, "compressed-tensors tensor")
    single = tp_engines(path, kv_cache_dtype="fp8_e4m3")
    engine = tp_engines(path, kv_cache_dtype="fp8_e4m3", tp_size=2)
    assert engine.config.quantization == "fp8" and engine.runner.kv_pool.quantized
    agrees_like_tp1(engine, single, tp_engines(tiny_models("llama")))


def test_quantization_fp8_at_tp2_quantizes_like_tp1(tiny_models, tp_engines):
    path = tiny_models("gpt2")  # fused q/k/v (three column blocks per rank) and biases on row-parallel layers
    single = tp_engines(path, quantization="fp8")
    engine = tp_engines(path, quantization="fp8", tp_size=2, disable_overlap_schedule=True)
    ours, full = (dict(e.runner.model.named_modules())["transformer.h.0.mlp.c_proj"] for e in (engine, single))
    # The row-parallel amax is taken over both ranks: rank 0's columns are tp = 1's, bit for bit.
    assert torch.equal(ours.weight_scale, full.weight_scale)
    assert torch.equal(ours.weight.view(torch.uint8), full.weight[:, : ours.in_features].contiguous().view(torch.uint8))
    agrees_like_tp1(engine, single, tp_engines(path))
