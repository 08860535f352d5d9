"""Write a Hugging Face checkpoint (tiny ones: common/tiny_model.py) as a GGUF file, the way llama.cpp's
convert_hf_to_gguf.py does: its tensor names, its Q/K permutation for llama-arch models, GPT-2's
transposed Conv1D weights and copied `output`, Llama 3's `rope_freqs`, its metadata keys and the
tokenizer. 2-D weights are quantized to `qtype` with gguf.quants.quantize; vectors stay F32.

Written apart from pdserve's reader (nothing imported from it), so that transformers' GGUF reader
checks this writer, and the writer then checks pdserve's reader.
"""

from __future__ import annotations

import json
import math
import pathlib

import gguf
import numpy as np
from safetensors.numpy import load_file

# HF architecture -> (llama.cpp architecture, does the converter permute Q/K rows)
ARCHES = {
    "LlamaForCausalLM": ("llama", True),
    "MistralForCausalLM": ("llama", True),  # llama.cpp converts Mistral as llama
    "Qwen2ForCausalLM": ("qwen2", False),
    "Qwen3ForCausalLM": ("qwen3", False),
    "GPT2LMHeadModel": ("gpt2", False),
}
# Hugging Face name (its leaf module) -> llama.cpp name
LLAMA_TENSORS = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
GPT2_TENSORS = {
    "transformer.wte": "token_embd",
    "transformer.wpe": "position_embd",
    "transformer.ln_f": "output_norm",
    "ln_1": "attn_norm",
    "attn.c_attn": "attn_qkv",
    "attn.c_proj": "attn_output",
    "ln_2": "ffn_norm",
    "mlp.c_fc": "ffn_up",
    "mlp.c_proj": "ffn_down",
}
CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def gguf_name(name: str, gpt2: bool) -> str:
    table = GPT2_TENSORS if gpt2 else LLAMA_TENSORS
    module, _, leaf = name.rpartition(".")
    parts = module.split(".")  # model.layers.N.<rest> or transformer.h.N.<rest>
    if len(parts) > 3 and parts[2].isdigit():
        return f"blk.{parts[2]}.{table['.'.join(parts[3:])]}.{leaf}"
    return f"{table[module]}.{leaf}"


def permute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """llama.cpp's LlamaModel.permute, as is."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def llama3_rope_freqs(config: dict) -> np.ndarray:
    """llama.cpp's LlamaModel.generate_extra_tensors for rope_type llama3: a divisor per frequency."""
    rope = config.get("rope_scaling") or config["rope_parameters"]
    base = config.get("rope_theta", rope.get("rope_theta"))
    dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def write_gguf(
    checkpoint: str | pathlib.Path,
    out: str | pathlib.Path,
    qtype=gguf.GGMLQuantizationType.F32,
    name: str = "tiny",
    metadata: dict | None = None,
) -> pathlib.Path:
    """`metadata`: more keys to write (float values as float32, int values as int32)."""
    checkpoint, out = pathlib.Path(checkpoint), pathlib.Path(out)
    config = json.loads((checkpoint / "config.json").read_text())
    hf_arch = config["architectures"][0]
    arch, permuted = ARCHES[hf_arch]
    gpt2 = arch == "gpt2"
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_name(f"{name} mistral" if hf_arch == "MistralForCausalLM" else name)
    _add_hparams(writer, config, arch)
    _add_tokenizer(writer, checkpoint)
    for key, value in (metadata or {}).items():
        (writer.add_float32 if isinstance(value, float) else writer.add_int32)(key, value)
    weights = load_file(str(checkpoint / "model.safetensors"))
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    if rope.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_freqs(config))
    for key in sorted(weights):
        data = weights[key]
        if gpt2 and key.endswith(CONV1D):
            data = data.T  # Conv1D [in, out] -> [out, in]
        if permuted and key.endswith(("q_proj.weight", "q_proj.bias")):
            data = permute(data, config["num_attention_heads"], config["num_attention_heads"])
        if permuted and key.endswith(("k_proj.weight", "k_proj.bias")):
            data = permute(data, config["num_attention_heads"], config["num_key_value_heads"])
        names = [gguf_name(key, gpt2)]
        if gpt2 and names[0] == "token_embd.weight":
            names.append("output.weight")  # llama.cpp's GPT-2 writes the tied head as a copy
        for tensor_name in names:
            _add_tensor(writer, tensor_name, np.ascontiguousarray(data, dtype=np.float32), qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _add_tensor(writer: gguf.GGUFWriter, name: str, data: np.ndarray, qtype) -> None:
    if data.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
        writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    else:
        writer.add_tensor(name, data)


def _add_hparams(writer: gguf.GGUFWriter, config: dict, arch: str) -> None:
    if arch == "gpt2":
        writer.add_context_length(config["n_positions"])
        writer.add_embedding_length(config["n_embd"])
        writer.add_feed_forward_length(config.get("n_inner") or 4 * config["n_embd"])
        writer.add_block_count(config["n_layer"])
        writer.add_head_count(config["n_head"])
        writer.add_layer_norm_eps(config["layer_norm_epsilon"])
        return
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config.get("rope_theta") or config["rope_parameters"]["rope_theta"])
    if config.get("head_dim"):
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
    if arch == "llama":
        writer.add_vocab_size(config["vocab_size"])
        writer.add_rope_dimension_count(
            config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        )
    if config.get("sliding_window") and config["architectures"][0] == "MistralForCausalLM":
        writer.add_sliding_window(config["sliding_window"])


def _add_tokenizer(writer: gguf.GGUFWriter, checkpoint: pathlib.Path) -> None:
    """A byte-level BPE vocabulary, as llama.cpp's _set_vocab_gpt2 writes it."""
    tokenizer = json.loads((checkpoint / "tokenizer.json").read_text())
    settings = json.loads((checkpoint / "tokenizer_config.json").read_text())
    generation = json.loads((checkpoint / "generation_config.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    special = {t["content"] for t in tokenizer["added_tokens"] if t["special"]}
    ids = {t: i for i, t in enumerate(tokens)}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens])
    merges = tokenizer["model"]["merges"]
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_bos_token_id(ids[settings["bos_token"]])
    writer.add_eos_token_id(ids[settings["eos_token"]])
    writer.add_pad_token_id(ids[settings["pad_token"]])
    for eos in generation["eos_token_id"]:  # the chat's end of turn, as llama.cpp's eot
        if eos != ids[settings["eos_token"]]:
            writer.add_eot_token_id(eos)
    writer.add_add_bos_token(True)
    writer.add_chat_template(settings["chat_template"])
