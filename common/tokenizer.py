"""Tokenizer loading and the stop ids a checkpoint declares (offline: no hub access).

A GGUF checkpoint carries both in its metadata (common/gguf_checkpoint.py)."""

from __future__ import annotations

import json
import os

from pdserve.common import gguf_checkpoint


def load_tokenizer(model_path: str):
    gguf = gguf_checkpoint.gguf_file(model_path)
    if gguf is not None:
        return gguf_checkpoint.load_tokenizer(gguf)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path, local_files_only=True)


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
