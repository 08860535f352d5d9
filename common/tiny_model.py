"""Tiny, deterministic, random-weight Hugging Face checkpoints for tests and benchmarks.

    make_tiny_model(out_dir, arch, seed=0) -> Path

writes config.json, generation_config.json, model.safetensors (float32) and a byte-level BPE
tokenizer (512 tokens, ChatML-style chat template) that `transformers` loads fully offline.
The same (arch, seed) always gives byte-identical files; the tokenizer does not depend on the seed.

Weights are scaled so that final logits have a std of about 4 (embeddings, position embeddings and
lm_head N(0, 0.5), other matrices N(0, 0.2), norm scales 1 + N(0, 0.1), biases N(0, 0.1)): the median
top-1/top-2 logit gap is then about 1, so float noise between implementations (~1e-5) rarely flips
a greedy argmax.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from tokenizers import Tokenizer

# NOTE: torch, safetensors and tokenizers are imported where they are used: `pdserve --help` (common/cli.py)
# reads ARCHS and must not pay for torch.

ARCHS = ("llama", "qwen2", "qwen3", "mistral", "gpt2")

VOCAB_SIZE = 512
SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>", "<|im_start|>", "<|im_end|>")  # ids 0..4
BOS_ID, EOS_ID, PAD_ID, IM_START_ID, IM_END_ID = range(len(SPECIAL_TOKENS))
EMBED_STD, LINEAR_STD, NORM_STD, BIAS_STD = 0.5, 0.2, 0.1, 0.1

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

CORPUS = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of foolishness.
Language models predict the next token from the tokens before it; a server batches many requests together,
keeps a cache of keys and values for every layer, and streams the generated text back to each client.
Prefill processes the whole prompt at once; decode adds one token per step until a stop condition is met.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 256 1024 3.14159 2.71828 -1 +7 1e-5 0x1F 50% $19.99 #1 @user
def fibonacci(n: int) -> int:
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a

class Cache:
    def __init__(self, size):
        self.pages = [None] * size  # fixed-size pages
        self.free = list(range(size))

    def alloc(self):
        if not self.free:
            raise MemoryError("out of pages")
        return self.free.pop()

for (int i = 0; i < n; ++i) { sum += x[i] * y[i]; }
{"model": "tiny", "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 16}
SELECT name, count(*) FROM requests WHERE status = 'done' GROUP BY name ORDER BY 2 DESC;
Français : « Où est la bibliothèque ? » — Il était une fois un garçon très curieux, à l'été déjà passé.
Deutsch: Die Straße ist schön, Äpfel und Öl kosten fünf Euro; Grüße aus München, Übung macht den Meister.
Español: ¿Dónde está el niño? ¡Qué mañana tan señorial! El pingüino comió jalapeños en Córdoba.
Português: Não há coração sem emoção; a canção é do avô. Čeština: Příliš žluťoučký kůň úpěl ďábelské ódy.
Polski: Zażółć gęślą jaźń. Türkçe: Pijamalı hasta yağız şoföre çabucak güvendi. Ελληνικά: Καλημέρα κόσμε.
Русский: Съешь же ещё этих мягких французских булок, да выпей чаю. Українська: Ґанок і їжак.
中文：我们的模型很小，但是它可以生成文字。今天天气很好，我们去公园散步吧。你好，世界！
日本語：こんにちは、世界。吾輩は猫である。名前はまだ無い。カタカナとひらがなと漢字。
한국어: 안녕하세요, 세계! 오늘 날씨가 좋네요. 감사합니다.
العربية: مرحبا بالعالم. עברית: שלום עולם. हिन्दी: नमस्ते दुनिया। ไทย: สวัสดีชาวโลก
Emoji: 😀 😂 🤖 🚀 🔥 👍🏽 ❤️ 🎉 🐍 🦀 🌍 ✨ 👨‍👩‍👧‍👦 🇫🇷 🇯🇵 ☕ ⚡ 🍕 🍣 📦
Math and symbols: ∀x ∈ ℝ, x² ≥ 0; ∑ᵢ aᵢ = π ≈ 3.14; α β γ δ ε λ μ σ Ω; → ← ↔ ≠ ≤ ≥ ∞ ° € £ ¥ © ™ § ¶ •
Tabs\tand  double  spaces, trailing spaces   and
blank lines.

The end.
"""


def make_tiny_model(
    out_dir: str | os.PathLike, arch: str, seed: int = 0, overrides: dict | None = None
) -> pathlib.Path:
    """Write a tiny random-weight checkpoint of `arch` (one of ARCHS) into out_dir; return its path.

    `overrides` replaces config.json fields (hidden size, layers, heads, vocab, ...) before the
    weights are drawn: benchmarks use it for realistic shapes with the same tokenizer.
    """
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = gpt2_config() if arch == "gpt2" else llama_like_config(arch)
    config.update(overrides or {})
    shapes = gpt2_shapes(config) if arch == "gpt2" else llama_like_shapes(arch, config)
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", generation_config())
    from safetensors.torch import save_file

    save_file(random_weights(shapes, seed), str(out / "model.safetensors"), metadata={"format": "pt"})
    write_tokenizer(out)
    return out


# ---------------------------------------------------------------------------------------------
# configs and weight shapes


def _token_ids() -> dict:
    return {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}


def llama_like_config(arch: str) -> dict:
    """config.json for the Llama family (llama, qwen2, qwen3, mistral)."""
    theta = {"llama": 500000.0, "mistral": 10000.0}.get(arch, 1000000.0)
    rope = {"rope_type": "default", "rope_theta": theta}
    config = {
        "architectures": [
            {
                "llama": "LlamaForCausalLM",
                "qwen2": "Qwen2ForCausalLM",
                "qwen3": "Qwen3ForCausalLM",
                "mistral": "MistralForCausalLM",
            }[arch]
        ],
        "model_type": arch,
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32 if arch == "qwen3" else 16,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 1024,
        "tie_word_embeddings": arch in ("qwen2", "qwen3"),
        "attention_dropout": 0.0,
        "rope_theta": theta,
        "dtype": "float32",
        "use_cache": True,
        **_token_ids(),
    }
    if arch == "llama":
        scaling = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256,
        }
        # The legacy form (rope_scaling + rope_theta) for older readers, and the transformers 5 form
        # (rope_parameters, which carries rope_theta inside) with the same values.
        config["rope_scaling"] = scaling
        rope = {**scaling, "rope_theta": theta}
    config["rope_parameters"] = rope
    if arch in ("llama", "mistral"):
        config.update(attention_bias=False, mlp_bias=False)
    if arch == "qwen3":
        config["attention_bias"] = False
    if arch in ("qwen2", "qwen3"):
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=2)
    if arch == "mistral":
        config["sliding_window"] = 48  # small on purpose: prompts in tests cross it
    return config


def llama_like_shapes(arch: str, config: dict) -> dict[str, tuple[int, ...]]:
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    q_dim = config["num_attention_heads"] * config["head_dim"]
    kv_dim = config["num_key_value_heads"] * config["head_dim"]
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (vocab, hidden)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (hidden,),
                p + "post_attention_layernorm.weight": (hidden,),
                p + "self_attn.q_proj.weight": (q_dim, hidden),
                p + "self_attn.k_proj.weight": (kv_dim, hidden),
                p + "self_attn.v_proj.weight": (kv_dim, hidden),
                p + "self_attn.o_proj.weight": (hidden, q_dim),
                p + "mlp.gate_proj.weight": (inter, hidden),
                p + "mlp.up_proj.weight": (inter, hidden),
                p + "mlp.down_proj.weight": (hidden, inter),
            }
        )
        if arch == "qwen2":  # Qwen2 always has q/k/v biases (there is no config switch)
            shapes.update(
                {
                    p + "self_attn.q_proj.bias": (q_dim,),
                    p + "self_attn.k_proj.bias": (kv_dim,),
                    p + "self_attn.v_proj.bias": (kv_dim,),
                }
            )
        if arch == "qwen3":
            shapes.update(
                {
                    p + "self_attn.q_norm.weight": (config["head_dim"],),
                    p + "self_attn.k_norm.weight": (config["head_dim"],),
                }
            )
    return shapes


def gpt2_config() -> dict:
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": VOCAB_SIZE,
        "n_embd": 64,
        "n_layer": 2,
        "n_head": 4,
        "n_inner": 128,
        "n_positions": 1024,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": 1e-5,
        "attn_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "resid_pdrop": 0.0,
        "scale_attn_weights": True,
        "tie_word_embeddings": True,
        "dtype": "float32",
        "use_cache": True,
        **_token_ids(),
    }


def gpt2_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """GPT-2 uses Conv1D, whose weight is [in, out] (transposed from nn.Linear). No lm_head.weight:
    it is tied to wte. No attn.bias / attn.masked_bias: transformers 5 has no such buffers."""
    d, inner = config["n_embd"], config["n_inner"]
    shapes = {
        "transformer.wte.weight": (config["vocab_size"], d),
        "transformer.wpe.weight": (config["n_positions"], d),
        "transformer.ln_f.weight": (d,),
        "transformer.ln_f.bias": (d,),
    }
    for i in range(config["n_layer"]):
        p = f"transformer.h.{i}."
        shapes.update(
            {
                p + "ln_1.weight": (d,),
                p + "ln_1.bias": (d,),
                p + "ln_2.weight": (d,),
                p + "ln_2.bias": (d,),
                p + "attn.c_attn.weight": (d, 3 * d),
                p + "attn.c_attn.bias": (3 * d,),
                p + "attn.c_proj.weight": (d, d),
                p + "attn.c_proj.bias": (d,),
                p + "mlp.c_fc.weight": (d, inner),
                p + "mlp.c_fc.bias": (inner,),
                p + "mlp.c_proj.weight": (inner, d),
                p + "mlp.c_proj.bias": (d,),
            }
        )
    return shapes


def generation_config() -> dict:
    return {"bos_token_id": BOS_ID, "eos_token_id": [EOS_ID, IM_END_ID], "pad_token_id": PAD_ID, "do_sample": False}


def random_weights(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, torch.Tensor]:
    """float32 tensors drawn from one seeded generator in sorted key order (so: reproducible)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name in sorted(shapes):
        noise = torch.randn(shapes[name], generator=gen, dtype=torch.float32)
        if name.endswith(".bias"):
            weights[name] = noise * BIAS_STD
        elif "norm" in name or ".ln_" in name:  # RMSNorm / LayerNorm scale
            weights[name] = 1.0 + noise * NORM_STD
        elif any(key in name for key in ("embed_tokens", "lm_head", "wte", "wpe")):
            weights[name] = noise * EMBED_STD
        else:
            weights[name] = noise * LINEAR_STD
    return weights


# ---------------------------------------------------------------------------------------------
# tokenizer


def train_tokenizer() -> Tokenizer:
    """Byte-level BPE trained on CORPUS to exactly VOCAB_SIZE tokens, specials at ids 0..4.

    Deterministic across processes although the trainer uses randomly seeded hash maps: it sorts
    the alphabet and breaks equal-count merges by pair ids, and CORPUS is fed in a fixed order.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=sorted(pre_tokenizers.ByteLevel.alphabet()),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", pair="<|bos|> $A $B:1", special_tokens=[("<|bos|>", BOS_ID)]
    )
    if tok.get_vocab_size() != VOCAB_SIZE:  # the trainer stops early, silently, if CORPUS runs out of pairs
        raise RuntimeError(f"trained {tok.get_vocab_size()} tokens, expected {VOCAB_SIZE}")
    return tok


def write_tokenizer(out: pathlib.Path) -> None:
    (out / "tokenizer.json").write_text(train_tokenizer().to_str(pretty=True), encoding="utf-8")
    special = {
        "bos_token": "<|bos|>",
        "eos_token": "<|eos|>",
        "pad_token": "<|pad|>",
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
    }
    _write_json(out / "special_tokens_map.json", special)
    _write_json(
        out / "tokenizer_config.json",
        {
            **special,
            "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": 1024,
            "clean_up_tokenization_spaces": False,
            "chat_template": CHAT_TEMPLATE,
        },
    )


def _write_json(path: pathlib.Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")
