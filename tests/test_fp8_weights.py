"""FP8 weights through the engine, on CPU: `--quantization fp8` on tiny Llama and GPT-2, FP8
checkpoints written here in the formats users download (compressed-tensors, per channel and per
tensor; quant_method fp8), and the formats and combinations refused at start-up.

The yardstick is a plain reference quantization computed here with torch's float8 casts: the
unquantized engine run on weights rounded through float8 per output channel, with every linear
layer's input rounded through float8 per token (a forward pre-hook). Teacher-forced top-1
agreement is bench/teacher_forced.py's score.
"""

import json
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from pdserve.bench.micro import fp8_checkpoints
from pdserve.bench.teacher_forced import TeacherForcedPlan, score
from pdserve.common.config import EngineConfig
from pdserve.common.engine.engine import Engine
from pdserve.common.engine.models.loader import load_model
from pdserve.common.types import SamplingParams

FP8 = torch.float8_e4m3fn
# The checkpoint tensors of the transformer blocks' linear layers (GPT-2's are Conv1D: [in, out]).
LLAMA_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GPT2_LINEARS = ("c_attn", "c_proj", "c_fc")
rng = random.Random(0)
PROMPTS = [[rng.randrange(5, 512) for _ in range(64)] for _ in range(8)]
PLAN = TeacherForcedPlan(items=[{"id": i} for i in range(len(PROMPTS))], prompt_ids=PROMPTS)


def is_block_linear(key: str) -> bool:
    return key.endswith(".weight") and key.split(".")[-2] in LLAMA_LINEARS + GPT2_LINEARS


def quantize(weight: torch.Tensor, out_dim: int, per_tensor: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 weight, scale) by plain torch casts: scale = amax / 448 per output channel (or tensor)."""
    if per_tensor:
        scale = weight.abs().amax() / 448
    else:
        scale = weight.abs().amax(dim=1 - out_dim, keepdim=True) / 448
    return (weight / scale).to(FP8), scale


def fake_quant_tokens(module: nn.Module, args: tuple) -> tuple:
    """A linear layer's input rounded through float8, one scale per token."""
    (x,) = args
    scale = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 448
    return (((x / scale).to(FP8).float() * scale).to(x.dtype),)


def engine_for(path, **overrides) -> Engine:
    return Engine(model_path=str(path), device="cpu", max_total_tokens=4096, **overrides)


def reference_engine(path) -> Engine:
    """The unquantized engine on `path` (weights already rounded through float8), its linear
    layers' inputs rounded per token."""
    engine = engine_for(path)
    linears = [m for m in engine.runner.model.modules() if isinstance(m, nn.Linear)]
    assert linears
    for m in linears:
        m.register_forward_pre_hook(fake_quant_tokens)
    return engine


def teacher_forced(engine: Engine) -> list[dict]:
    """Per prompt: the top-1 token after each prefix, and the logprob of the prompt's own next token."""
    outs = engine.generate(PROMPTS, [SamplingParams(max_new_tokens=1, temperature=0, prompt_logprobs=1)] * len(PROMPTS))
    return [
        {
            "top1": [lp.top[0][0] for lp in o.prompt_logprobs[1:]],
            "logprobs": [lp.logprob for lp in o.prompt_logprobs[1:]],
        }
        for o in outs
    ]


def write_dequantized(src, dst, per_tensor: bool = False) -> str:
    """A copy of checkpoint `src` whose block linear weights are rounded through float8 (float32)."""
    shutil.copytree(src, dst)
    weights = load_file(f"{src}/model.safetensors")
    gpt2 = "GPT2LMHeadModel" in json.loads(open(f"{src}/config.json").read())["architectures"]
    for key in [k for k in weights if is_block_linear(k)]:
        q, scale = quantize(weights[key], out_dim=1 if gpt2 else 0, per_tensor=per_tensor)
        weights[key] = q.float() * scale
    save_file(weights, f"{dst}/model.safetensors", metadata={"format": "pt"})
    return str(dst)


def compressed_tensors_config(strategy: str) -> dict:
    fp8_of = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None, "block_structure": None}
    return fp8_checkpoints.compressed_tensors_config(
        {**fp8_of, "strategy": strategy, "dynamic": False, "observer": "minmax"},
        {**fp8_of, "strategy": "token", "dynamic": True, "observer": None},
    )


FORMATS = {
    "compressed-tensors channel": compressed_tensors_config("channel"),
    "compressed-tensors tensor": compressed_tensors_config("tensor"),
    "fp8 tensor": {"quant_method": "fp8", "activation_scheme": "dynamic"},  # AutoFP8 / vLLM: scalar scales
}


def write_fp8_checkpoint(src, dst, form: str) -> dict:
    """Checkpoint `src` (a Llama) in FP8 as `form` stores it: float8 weights, their scales beside
    them, quantization_config in config.json. Returns the stored scales by layer."""
    shutil.copytree(src, dst)
    weights, scales = load_file(f"{src}/model.safetensors"), {}
    # weight_scale as each format stores it: [N, 1] per channel, [1] per tensor, a scalar in fp8's.
    shape = {"compressed-tensors channel": (-1, 1), "compressed-tensors tensor": (1,), "fp8 tensor": ()}[form]
    for key in [k for k in weights if is_block_linear(k)]:
        q, scale = quantize(weights[key], out_dim=0, per_tensor=form.endswith(" tensor"))
        layer = key.removesuffix(".weight")
        weights[key], weights[f"{layer}.weight_scale"] = q, scale.reshape(shape)
        scales[layer] = scale.reshape(-1)
    save_file(weights, f"{dst}/model.safetensors", metadata={"format": "pt"})
    config = json.loads(open(f"{src}/config.json").read())
    config["quantization_config"] = FORMATS[form]
    open(f"{dst}/config.json", "w").write(json.dumps(config))
    return scales


def assert_block_linears_are_fp8(model: nn.Module, per_layer: int) -> None:
    """Every linear weight of the blocks float8 (quantization not skipped); the LM head, the
    embeddings and the norms float32."""
    params = dict(model.named_parameters())
    fp8_weights = [n for n, p in params.items() if p.dtype == FP8]
    assert len(fp8_weights) == per_layer * 2 and all(is_block_linear(n) for n in fp8_weights), fp8_weights
    assert all(params[n.removesuffix("weight") + "weight_scale"].dtype == torch.float32 for n in fp8_weights)
    others = [n for n, p in params.items() if p.dtype != FP8 and not n.endswith("weight_scale")]
    assert any("lm_head" in n or "embed" in n or "wte" in n for n in others)
    assert all(params[n].dtype == torch.float32 for n in others)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_quantization_fp8_agrees_like_a_plain_reference_quantization(arch, tiny_models, tmp_path):
    path = tiny_models(arch)
    base = teacher_forced(engine_for(path))
    quantized = engine_for(path, quantization="fp8")
    assert quantized.config.quantization == "fp8"
    assert_block_linears_are_fp8(quantized.runner.model, per_layer=len(LLAMA_LINEARS) if arch == "llama" else 4)
    ours = teacher_forced(quantized)
    reference = teacher_forced(reference_engine(write_dequantized(path, tmp_path / "reference")))
    mine, plain = score(PLAN, ours, base), score(PLAN, reference, base)
    print(
        f"\n{arch} top-1 vs unquantized: --quantization fp8 {mine['agreement']:.2%}, reference {plain['agreement']:.2%}"
    )
    assert mine["agreement"] >= plain["agreement"] - 0.05
    assert mine["max_abs_logprob_diff"] > 1e-2, "the logprobs are the unquantized ones: quantization skipped"
    # The reference computes the same numbers by other means: nearly every position agrees.
    assert score(PLAN, ours, reference)["agreement"] >= 0.95


@pytest.mark.parametrize("form", FORMATS)
def test_an_fp8_checkpoint_loads_as_it_is_and_serves(form, tiny_models, tmp_path):
    path = tiny_models("llama")
    scales = write_fp8_checkpoint(path, tmp_path / "fp8", form)
    engine = engine_for(tmp_path / "fp8")  # no --quantization: the checkpoint says FP8
    assert engine.config.quantization == "fp8"
    model = engine.runner.model
    assert_block_linears_are_fp8(model, per_layer=len(LLAMA_LINEARS))
    for layer, stored in scales.items():  # per-tensor scales repeated on every row of their layer
        loaded = model.get_submodule(layer).weight_scale
        assert torch.equal(loaded, stored.expand(loaded.shape)), layer
    [out] = engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True))
    assert len(out.output_ids) == 8
    served = teacher_forced(engine)
    reference = teacher_forced(reference_engine(write_dequantized(path, tmp_path / "ref", form.endswith(" tensor"))))
    assert score(PLAN, served, reference)["agreement"] >= 0.95
    assert score(PLAN, served, teacher_forced(engine_for(path)))["max_abs_logprob_diff"] > 1e-2
    if form == "compressed-tensors channel":  # the same weights --quantization fp8 makes of the original
        quantized_at_load = teacher_forced(engine_for(path, quantization="fp8"))
        assert score(PLAN, served, quantized_at_load)["max_abs_logprob_diff"] < 1e-5


def write_config(src, dst, quantization_config: dict) -> str:
    """A checkpoint directory whose config.json carries `quantization_config` (the start-up checks
    read config.json only)."""
    config = json.loads(open(f"{src}/config.json").read())
    dst.mkdir()
    (dst / "config.json").write_text(json.dumps({**config, "quantization_config": quantization_config}))
    return str(dst)


def with_group(change: dict) -> dict:
    config = compressed_tensors_config("channel")
    group = config["config_groups"]["group_0"]
    for field, values in change.items():
        group[field] = None if values is None else {**group[field], **values}
    return config


REFUSED = {
    "blocks of another size": (
        {"quant_method": "fp8", "weight_block_size": [128, 96]},
        r"weight_block_size \[128, 96\]: block-wise FP8 weights need .* block_k one of \[32, 64, 128, 256\]",
    ),
    "fp8 static activations": ({"quant_method": "fp8", "activation_scheme": "static"}, "activation_scheme 'static'"),
    "static activations": (with_group({"input_activations": {"dynamic": False}}), r"input_activations\.dynamic"),
    "group-wise": (with_group({"weights": {"strategy": "group", "group_size": 128}}), "strategy 'group'"),
    "int8 weights": (with_group({"weights": {"type": "int"}}), "type 'int' is not supported"),
    "kv cache scales": (
        {**compressed_tensors_config("channel"), "kv_cache_scheme": {"num_bits": 8}},
        "kv_cache_scheme",
    ),
    "unknown method": ({"quant_method": "awq", "bits": 4}, "quant_method 'awq' is not supported"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_unsupported_checkpoint_formats_stop_the_start(case, tiny_models, tmp_path):
    quantization_config, message = REFUSED[case]
    path = write_config(tiny_models("llama"), tmp_path / "ckpt", quantization_config)
    with pytest.raises(ValueError, match=message):
        EngineConfig(model_path=path, device="cpu").resolve()


def test_fp8_on_a_gguf_quantizes_its_dequantized_weights(tiny_models, tmp_path):
    """A GGUF's weights are dequantized at load, then --quantization fp8 quantizes them like any
    float checkpoint's: an F32 GGUF (exactly its checkpoint's weights) serves what the checkpoint does."""
    from tests.tiny_gguf import write_gguf

    llama = tiny_models("llama")
    gguf = write_gguf(llama, tmp_path / "tiny.gguf")
    engine = engine_for(gguf, quantization="fp8")
    assert engine.config.quantization == "fp8"
    assert_block_linears_are_fp8(engine.runner.model, per_layer=7)
    served, checkpoint = teacher_forced(engine), teacher_forced(engine_for(llama, quantization="fp8"))
    assert [p["top1"] for p in served] == [p["top1"] for p in checkpoint]
    for a, b in zip(served, checkpoint, strict=True):
        assert a["logprobs"] == pytest.approx(b["logprobs"], abs=1e-5)


def test_an_unknown_choice_stops_the_start_and_fp8_takes_tp(tiny_models, tmp_path):
    llama = tiny_models("llama")
    assert EngineConfig(model_path=llama, device="cpu", quantization="fp8").resolve().quantization == "fp8"
    assert EngineConfig(model_path=llama, device="cpu").resolve().quantization == ""
    with pytest.raises(ValueError, match="--quantization must be fp8, fp8-block or empty"):
        EngineConfig(model_path=llama, device="cpu", quantization="int8").resolve()
    # With TP each rank holds its shard of the FP8 layers (tests/test_tp_fp8.py).
    assert EngineConfig(model_path=llama, device="cpu", quantization="fp8", tp_size=2).resolve().quantization == "fp8"
    fp8_checkpoint = write_config(llama, tmp_path / "fp8", compressed_tensors_config("channel"))
    assert EngineConfig(model_path=fp8_checkpoint, device="cpu", tp_size=2).resolve().quantization == "fp8"


def test_fp8_tensors_without_their_scale_or_with_static_input_scales_are_refused(tiny_models, tmp_path):
    path = tmp_path / "fp8"
    write_fp8_checkpoint(tiny_models("llama"), path, "compressed-tensors channel")
    weights = load_file(f"{path}/model.safetensors")
    scale = weights.pop("model.layers.1.mlp.up_proj.weight_scale")
    save_file(weights, f"{path}/model.safetensors")
    with pytest.raises(ValueError, match="up_proj.weight' is torch.float8_e4m3fn, the model's is torch.float32"):
        load_model(str(path), torch.float32, "cpu")
    weights["model.layers.1.mlp.up_proj.weight_scale"] = scale
    weights["model.layers.1.mlp.up_proj.input_scale"] = torch.tensor([0.01])
    save_file(weights, f"{path}/model.safetensors")
    with pytest.raises(ValueError, match=r"static activation scales \(input_scale\)"):
        load_model(str(path), torch.float32, "cpu")
