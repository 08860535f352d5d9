"""Tiny checkpoints: load cleanly in transformers, run, are byte-reproducible, and carry a sane tokenizer."""

import json
import os
import subprocess
import sys

import pytest
import torch

from pdserve.common.tiny_model import ARCHS, CORPUS, make_tiny_model

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
    "gpt2": "GPT2LMHeadModel",
}
FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """arch -> checkpoint directory (seed 0), each built once for this module."""
    root = tmp_path_factory.mktemp("tiny_seed0")
    return {arch: make_tiny_model(root / arch, arch, seed=0) for arch in ARCHS}


@pytest.fixture(scope="module")
def tokenizer(checkpoints):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(checkpoints["llama"])


def load(path):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    return model.eval(), info


def read_all(path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


@pytest.mark.parametrize("arch", ARCHS)
def test_loads_without_missing_or_unexpected_keys(checkpoints, arch):
    model, info = load(checkpoints[arch])
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set()
    assert info["mismatched_keys"] == set() and not info["error_msgs"]
    assert {p.name for p in checkpoints[arch].iterdir()} == FILES
    assert model.config.architectures == [ARCHITECTURES[arch]]
    assert type(model).__name__ == ARCHITECTURES[arch]
    assert model.dtype == torch.float32
    assert model.config.vocab_size == 512
    assert (model.config.bos_token_id, model.config.eos_token_id, model.config.pad_token_id) == (0, 1, 2)
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert tied == (arch in ("qwen2", "qwen3", "gpt2"))


@pytest.mark.parametrize("arch", ARCHS)
def test_forward_and_greedy_generate(checkpoints, arch):
    model, _ = load(checkpoints[arch])
    ids = torch.tensor([[0] + list(range(100, 130))])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, 31, 512)
    # Logits must be far from uniform so greedy parity with transformers is robust to float noise.
    assert 2.5 < logits.std(-1).mean().item() < 6.0
    top2 = logits.topk(2, dim=-1).values
    assert (top2[..., 0] - top2[..., 1]).median().item() > 0.2
    out = model.generate(ids, max_new_tokens=8, min_new_tokens=8)  # greedy: generation_config do_sample=false
    assert out.shape == (1, 39) and torch.equal(out[:, :31], ids)
    assert torch.equal(out, model.generate(ids, max_new_tokens=8, min_new_tokens=8))
    assert model.generation_config.do_sample is False
    assert model.generation_config.eos_token_id == [1, 4]


def test_arch_specific_config(checkpoints):
    llama, _ = load(checkpoints["llama"])
    rope = llama.config.rope_parameters
    assert rope["rope_type"] == "llama3" and rope["rope_theta"] == 500000.0
    assert (rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]) == (8.0, 1.0, 4.0)
    assert rope["original_max_position_embeddings"] == 256
    assert llama.model.layers[0].self_attn.k_proj.weight.shape == (32, 64)  # GQA: 2 kv heads x 16

    mistral, _ = load(checkpoints["mistral"])
    assert mistral.config.sliding_window == 48
    assert mistral.config.rope_parameters == {"rope_type": "default", "rope_theta": 10000.0}

    qwen2, _ = load(checkpoints["qwen2"])
    assert qwen2.model.layers[0].self_attn.q_proj.bias is not None
    assert qwen2.config.use_sliding_window is False and qwen2.config.rope_parameters["rope_theta"] == 1e6

    qwen3, _ = load(checkpoints["qwen3"])
    attn = qwen3.model.layers[0].self_attn
    assert qwen3.config.head_dim == 32 and attn.q_proj.weight.shape == (128, 64)
    assert attn.q_proj.bias is None and attn.q_norm.weight.shape == (32,)

    gpt2, _ = load(checkpoints["gpt2"])
    assert gpt2.transformer.h[0].attn.c_attn.weight.shape == (64, 192)  # Conv1D: [in, out]
    assert gpt2.transformer.h[0].mlp.c_fc.weight.shape == (64, 128)
    assert gpt2.config.activation_function == "gelu_new"


@pytest.mark.parametrize("arch", ARCHS)
def test_same_seed_same_bytes_and_different_seed_different_weights(checkpoints, tmp_path, arch):
    again = make_tiny_model(tmp_path / "again", arch, seed=0)
    assert read_all(again) == read_all(checkpoints[arch])
    other = read_all(make_tiny_model(tmp_path / "other", arch, seed=1))
    base = read_all(checkpoints[arch])
    assert other["model.safetensors"] != base["model.safetensors"]
    assert {k: v for k, v in other.items() if k != "model.safetensors"} == {
        k: v for k, v in base.items() if k != "model.safetensors"
    }


def test_same_bytes_in_another_process(checkpoints, tmp_path):
    """Hash seeds and thread counts differ between processes; the files must not."""
    code = (
        "import sys; from pdserve.common.tiny_model import ARCHS, make_tiny_model\n"
        "[make_tiny_model(f'{sys.argv[1]}/{a}', a, 0) for a in ARCHS]"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345", "RAYON_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True, env=env, timeout=120)
    for arch in ARCHS:
        assert read_all(tmp_path / arch) == read_all(checkpoints[arch]), arch


def test_tokenizer_special_tokens(tokenizer, checkpoints):
    assert tokenizer.is_fast and len(tokenizer) == 512
    assert tokenizer.convert_ids_to_tokens([0, 1, 2, 3, 4]) == [
        "<|bos|>",
        "<|eos|>",
        "<|pad|>",
        "<|im_start|>",
        "<|im_end|>",
    ]
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (0, 1, 2)
    assert sorted(tokenizer.all_special_ids) == [0, 1, 2, 3, 4]
    config = json.loads((checkpoints["gpt2"] / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (0, 1, 2)
    ids = tokenizer("hello world").input_ids
    assert ids[0] == 0 and 0 not in ids[1:]
    assert tokenizer("hello world", add_special_tokens=False).input_ids == ids[1:]


def test_chat_template(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 👋"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|bos|><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi 👋<|im_end|>\n<|im_start|>assistant\n"
    )
    no_prompt = tokenizer.apply_chat_template(messages, tokenize=False)
    assert no_prompt == text.removesuffix("<|im_start|>assistant\n")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    assert ids[:2] == [0, 3] and ids.count(0) == 1 and ids.count(3) == 3 and ids.count(4) == 2


@pytest.mark.parametrize(
    "text",
    [CORPUS, "Zürich, 東京, Ωμέγα, 🦙🧪, naïve café — ½ ⅞", "  leading and trailing  \n\t", "x" * 300],
)
def test_unicode_round_trip(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert all(0 <= i < 512 for i in ids)
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode([0] + ids + [1], skip_special_tokens=True) == text


def test_tokenizer_compresses_its_corpus(tokenizer):
    """Training really happened: merges make the corpus far shorter than its UTF-8 bytes."""
    assert len(tokenizer(CORPUS, add_special_tokens=False).input_ids) < 0.8 * len(CORPUS.encode())
