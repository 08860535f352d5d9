"""Tokenizer loading and the stop ids a checkpoint declares (offline: no hub access)."""

from __future__ import annotations

import json
import os


def load_tokenizer(model_path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path, local_files_only=True)


def eos_token_ids(model_path: str, tokenizer) -> tuple[int, ...]:
    """EOS ids from generation_config.json (int or list) plus the tokenizer's eos token."""
    ids: list[int] = []
    path = os.path.join(model_path, "generation_config.json")
    if os.path.exists(path):
        with open(path) as f:
            eos = json.load(f).get("eos_token_id")
        ids += eos if isinstance(eos, list) else [eos] if eos is not None else []
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return tuple(dict.fromkeys(ids))
