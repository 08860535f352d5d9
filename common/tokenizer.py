"""Tokenizer loading and the stop ids a checkpoint declares (offline: no hub access).

A GGUF checkpoint carries both in its metadata (common/gguf_checkpoint.py, common/gguf_tokenizer.py)."""

from __future__ import annotations

import json
import os

from pdserve.common import gguf_checkpoint, gguf_tokenizer


def load_tokenizer(model_path: str):
    gguf = gguf_checkpoint.gguf_file(model_path)
    if gguf is not None:
        return gguf_tokenizer.load_tokenizer(gguf)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path, local_files_only=True, config=_tokenizer_facts(model_path))


def _tokenizer_facts(model_path: str):
    """What AutoTokenizer reads of the model's config (model_type, tokenizer_class, auto_map), in a
    bare PreTrainedConfig; None (AutoTokenizer then loads the config itself) without a config.json.

    NOTE why: given no config, AutoTokenizer builds the model's own config class, and for Llama,
    Qwen and Mistral that module imports transformers' model-loading stack (activations, hub
    kernels, torch.distributed.tensor): 2.5-2.9 s of a Llama-family server's start-up, and of every
    router worker's, for three strings. The tokenizer it picks is the same (tests/test_tokenizer.py).
    """
    try:
        with open(os.path.join(model_path, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    from transformers.configuration_utils import PreTrainedConfig

    facts = PreTrainedConfig()
    facts.model_type = config.get("model_type", "")
    facts._name_or_path = model_path
    for key in ("tokenizer_class", "auto_map"):
        if config.get(key):
            setattr(facts, key, config[key])
    return facts


def eos_token_ids(model_path: str, tokenizer) -> tuple[int, ...]:
    """EOS ids from generation_config.json (int or list) plus the tokenizer's eos token."""
    gguf = gguf_checkpoint.gguf_file(model_path)
    if gguf is not None:
        return gguf_checkpoint.eos_token_ids(gguf, tokenizer)
    ids: list[int] = []
    path = os.path.join(model_path, "generation_config.json")
    if os.path.exists(path):
        with open(path) as f:
            eos = json.load(f).get("eos_token_id")
        ids += eos if isinstance(eos, list) else [eos] if eos is not None else []
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return tuple(dict.fromkeys(ids))
