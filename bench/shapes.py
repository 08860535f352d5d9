"""Model shapes for random-weight benchmark checkpoints, named `ARCH/SHAPE`.

`ARCH/tiny` is make_tiny_model's own shape for every architecture it knows (the tests use it);
the named full-size shapes are config.json overrides on top of the architecture's tiny config.
"""

from __future__ import annotations

from pdserve.common.tiny_model import ARCHS

SHAPES: dict[str, tuple[str, dict]] = {
    # GPT-2 small (124M).
    "gpt2/small": ("gpt2", {"n_embd": 768, "n_layer": 12, "n_head": 12, "n_inner": 3072, "vocab_size": 50257,
                            "n_positions": 1024}),
    # Llama-3.2-1B's shape (1.24B parameters, tied embeddings). The context is cut to 4096 so the
    # engine's per-request tables stay small; RoPE keeps the tiny config's llama3 scaling (its
    # values do not change the cost).
    "llama/1b": ("llama", {"hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32,
                           "num_key_value_heads": 8, "head_dim": 64, "intermediate_size": 8192, "vocab_size": 128256,
                           "max_position_embeddings": 4096, "tie_word_embeddings": True}),
    # Llama-3.1-8B's shape (8.03B parameters, untied), for tensor parallelism's TP1/TP2 comparison
    # (16 GB of bf16 weights: the checkpoint is built once on the GPU host's disk).
    "llama/8b": ("llama", {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
                           "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 14336, "vocab_size": 128256,
                           "max_position_embeddings": 4096, "tie_word_embeddings": False}),
}  # fmt: skip

TINY = "tiny"


def shape_names() -> list[str]:
    return sorted(SHAPES) + [f"{arch}/{TINY}" for arch in ARCHS]


def resolve_shape(name: str) -> tuple[str, dict]:
    """(arch, config overrides) of `ARCH/SHAPE`; ValueError naming the known shapes otherwise."""
    if name in SHAPES:
        arch, overrides = SHAPES[name]
        return arch, dict(overrides)
    arch, _, shape = name.partition("/")
    if shape == TINY and arch in ARCHS:
        return arch, {}
    raise ValueError(f"unknown shape {name!r}; known: {', '.join(shape_names())}")
