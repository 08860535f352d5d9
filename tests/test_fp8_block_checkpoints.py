"""Block-wise FP8 checkpoints through the engine, on CPU: both spellings users download, written here
from tiny models with the tensor names and config fields the real ones use, served as they are and
checked against the dequantized model; `--quantization fp8-block`; the schemes refused at start-up.

    fp8 block          quant_method fp8, weight_block_size [128, 128], activation_scheme dynamic, fmt
                       e4m3; `<layer>.weight_scale_inv` [ceil(N/128), ceil(K/128)] (DeepSeek-V3, Qwen3-*-FP8)
    compressed block   compressed-tensors, weights {strategy: block, block_structure: [128, 128]}, input
                       activations dynamic groups of 128; `<layer>.weight_scale` (llm-compressor's FP8_BLOCK)

The tiny models are widened (hidden 256, MLP 320, q 256 rows, k/v 64) so that every projection has
several 128 x 128 tiles, partial ones included. The yardstick is the dequantized checkpoint (each
weight float8 value times its tile's scale, in fp32) with every block linear layer's input rounded
through float8 per token and group of 128 (a forward pre-hook): the numbers the checkpoints define,
computed by other means. transformers runs that model too (greedy tokens equal).
"""

import json
import random

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from pdserve.bench.micro.fp8_checkpoints import (
    FP8_BLOCK_CONFIG,
    LINEARS,
    WIDE,
    compressed_block_config,
    write_block_checkpoints,
)
from pdserve.bench.teacher_forced import TeacherForcedPlan, score
from pdserve.common.config import EngineConfig
from pdserve.common.engine.engine import Engine
from pdserve.common.engine.models.fp8_block import Fp8BlockLinear
from pdserve.common.engine.models.loader import load_model
from pdserve.common.tiny_model import make_tiny_model
from pdserve.common.types import SamplingParams

FP8 = torch.float8_e4m3fn
rng = random.Random(0)
PROMPTS = [[rng.randrange(5, 512) for _ in range(48)] for _ in range(6)]
PLAN = TeacherForcedPlan(items=[{"id": i} for i in range(len(PROMPTS))], prompt_ids=PROMPTS)


@pytest.fixture(scope="module")
def wide_models(tmp_path_factory):
    root, built = tmp_path_factory.mktemp("wide"), {}

    def get(arch: str) -> str:
        if arch not in built:
            built[arch] = str(make_tiny_model(root / arch, arch, seed=0, overrides=WIDE))
        return built[arch]

    return get


def fake_quant_groups(module: nn.Module, args: tuple) -> tuple:
    """A linear layer's input rounded through float8, one scale per token and group of 128."""
    (x,) = args
    groups = x.unflatten(-1, (-1, 128)) if x.shape[-1] % 128 == 0 else None
    if groups is None:  # a partial last group: pad it with zeros (they change no amax)
        pad = torch.nn.functional.pad(x, (0, 128 - x.shape[-1] % 128))
        groups = pad.unflatten(-1, (-1, 128))
    scale = groups.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 448
    back = ((groups / scale).to(FP8).float() * scale).flatten(-2)[..., : x.shape[-1]]
    return (back.to(x.dtype),)


def hook_block_linears(model: nn.Module) -> int:
    """Fake-quantize the inputs of the transformer blocks' nn.Linears (not an LM head); returns how many."""
    linears = [m for name, m in model.named_modules() if isinstance(m, nn.Linear) and ".layers." in f".{name}"]
    for m in linears:
        m.register_forward_pre_hook(fake_quant_groups)
    return len(linears)


def engine_for(path, **overrides) -> Engine:
    return Engine(model_path=str(path), device="cpu", max_total_tokens=4096, **overrides)


def teacher_forced(engine: Engine) -> list[dict]:
    params = SamplingParams(max_new_tokens=1, temperature=0, prompt_logprobs=1)
    outs = engine.generate(PROMPTS, [params] * len(PROMPTS))
    return [
        {
            "top1": [lp.top[0][0] for lp in o.prompt_logprobs[1:]],
            "logprobs": [lp.logprob for lp in o.prompt_logprobs[1:]],
        }
        for o in outs
    ]


def greedy(engine: Engine, n: int = 12) -> list[list[int]]:
    params = SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)
    return [o.output_ids for o in engine.generate(PROMPTS[:3], [params] * 3)]


def transformers_greedy(path: str, n: int = 12) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32).eval()
    assert hook_block_linears(hf) == len(LINEARS) * hf.config.num_hidden_layers
    outs = []
    for ids in PROMPTS[:3]:
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
        outs.append(out[0, len(ids) :].tolist())
    return outs


@pytest.mark.parametrize(
    "arch,form",
    [("llama", "fp8 block"), ("qwen2", "fp8 block"), ("qwen3", "compressed block"), ("mistral", "compressed block")],
)
def test_a_block_checkpoint_serves_the_dequantized_models_numbers(arch, form, wide_models, tmp_path):
    """Loaded FP8 as it is (float8 weights, their block scales as stored), no flag needed; teacher-forced
    top-1 agreement with the dequantized model with group-quantized inputs >= 99% (measured: 100%, the
    same logprobs to the bit), and greedy tokens equal to transformers' on that model."""
    quantized, dequantized, scales = write_block_checkpoints(wide_models(arch), tmp_path, form)
    engine = engine_for(quantized)
    assert engine.config.quantization == "fp8-block"
    model = engine.runner.model
    layers = [m for m in model.modules() if isinstance(m, Fp8BlockLinear)]
    assert len(layers) == len(LINEARS) * 2 and all(m.weight.dtype == FP8 and m.block == (128, 128) for m in layers)
    for layer, stored in scales.items():
        assert torch.equal(model.get_submodule(layer).weight_scale, stored), layer
    assert model.get_submodule("model.layers.0.mlp.down_proj").weight_scale.shape == (2, 3)  # 256 x 320: partial K

    served = teacher_forced(engine)
    reference = engine_for(dequantized)
    assert hook_block_linears(reference.runner.model) == len(LINEARS) * 2
    against_reference = score(PLAN, served, teacher_forced(reference))
    against_float_inputs = score(PLAN, served, teacher_forced(engine_for(dequantized)))
    print(
        f"\n{arch} {form}: top-1 vs dequantized + group-quantized inputs {against_reference['agreement']:.2%} "
        f"(max |d logprob| {against_reference['max_abs_logprob_diff']:.1e}); vs dequantized, float inputs "
        f"{against_float_inputs['agreement']:.2%}"
    )
    assert against_reference["agreement"] >= 0.99 and against_reference["max_abs_logprob_diff"] < 1e-3
    assert against_float_inputs["max_abs_logprob_diff"] > 1e-3, "the inputs were not quantized"
    assert greedy(engine) == transformers_greedy(dequantized)


def test_quantization_fp8_block_is_the_block_checkpoint_of_the_same_weights(wide_models, tmp_path):
    """--quantization fp8-block on a float checkpoint: 128 x 128 tiles, the numbers a block-wise
    checkpoint of the same weights serves. (Which of fp8 and fp8-block is closer to the float model
    is measured on a real one, docs/benchmarks/fp8.md: a tiny random model's near-flat logits flip
    with any rounding.)"""
    path = wide_models("llama")
    quantized, _, _ = write_block_checkpoints(path, tmp_path, "fp8 block")
    engine = engine_for(path, quantization="fp8-block")
    assert engine.config.quantization == "fp8-block"
    assert sum(isinstance(m, Fp8BlockLinear) and m.block == (128, 128) for m in engine.runner.model.modules()) == 14
    served = teacher_forced(engine)
    assert score(PLAN, served, teacher_forced(engine_for(quantized)))["max_abs_logprob_diff"] < 1e-5
    assert score(PLAN, served, teacher_forced(engine_for(path)))["max_abs_logprob_diff"] > 1e-3, "not quantized"


def test_a_block_checkpoint_wins_over_the_flag_and_needs_tp_1(tiny_models, tmp_path):
    path = write_config(tiny_models("llama"), tmp_path / "ckpt", FP8_BLOCK_CONFIG)
    for flag in ("", "fp8", "fp8-block"):
        assert EngineConfig(model_path=path, device="cpu", quantization=flag).resolve().quantization == "fp8-block"
    with pytest.raises(ValueError, match="need --tp-size 1"):
        EngineConfig(model_path=path, device="cpu", tp_size=2).resolve()
    plain = tiny_models("llama")
    assert EngineConfig(model_path=plain, device="cpu", quantization="fp8-block").resolve().quantization == "fp8-block"


def write_config(src, dst, quantization_config: dict) -> str:
    config = json.loads(open(f"{src}/config.json").read())
    dst.mkdir()
    (dst / "config.json").write_text(json.dumps({**config, "quantization_config": quantization_config}))
    return str(dst)


def mixed_groups() -> dict:
    config = compressed_block_config()
    channel = json.loads(json.dumps(config["config_groups"]["group_0"]))
    channel["weights"].update(strategy="channel", block_structure=None)
    channel["input_activations"].update(strategy="token", group_size=None)
    config["config_groups"]["group_1"] = channel
    return config


REFUSED = {
    "fp8 blocks with static activations": (
        {**FP8_BLOCK_CONFIG, "activation_scheme": "static"},
        "activation_scheme 'static': static activation scales",
    ),
    "fp8 blocks of K 100": ({**FP8_BLOCK_CONFIG, "weight_block_size": [128, 100]}, r"block_k one of \[32, 64"),
    "fp8 blocks not a pair": ({**FP8_BLOCK_CONFIG, "weight_block_size": [128]}, r"weight_block_size \[128\]"),
    "compressed blocks with static inputs": (compressed_block_config(inputs={"dynamic": False}), "dynamic is false"),
    "compressed blocks with per-token inputs": (
        compressed_block_config(inputs={"strategy": "token", "group_size": None}),
        "strategy 'token', group_size None with block weights is not supported",
    ),
    "compressed blocks with groups of 64": (
        compressed_block_config(inputs={"group_size": 64}),
        r"group_size 64 .* \(dynamic groups of 128",
    ),
    "compressed blocks of K 48": (compressed_block_config(block=(128, 48)), r"block_structure \[128, 48\]"),
    "block and channel groups mixed": (mixed_groups(), "mix weight forms"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_unsupported_block_schemes_stop_the_start(case, tiny_models, tmp_path):
    quantization_config, message = REFUSED[case]
    path = write_config(tiny_models("llama"), tmp_path / "ckpt", quantization_config)
    with pytest.raises(ValueError, match=message):
        EngineConfig(model_path=path, device="cpu").resolve()


def test_block_scales_of_the_wrong_shape_stop_the_load(wide_models, tmp_path):
    quantized, _, _ = write_block_checkpoints(wide_models("llama"), tmp_path, "fp8 block")
    weights = load_file(f"{quantized}/model.safetensors")
    weights["model.layers.1.mlp.up_proj.weight_scale_inv"] = torch.ones(320, 1)  # per-channel, in a block checkpoint
    save_file(weights, f"{quantized}/model.safetensors")
    with pytest.raises(ValueError, match=r"up_proj.weight_scale_inv': shape \(320, 1\) != \(3, 2\)"):
        load_model(quantized, torch.float32, "cpu")
