"""load_tokenizer (common/tokenizer.py) picks the tokenizer AutoTokenizer would, without building the
model's config class (whose module, for Llama-family models, imports transformers' model-loading stack)."""

import subprocess
import sys

import pytest

from pdserve.common.tiny_model import ARCHS

TEXT = "Hello world, <|im_start|>user\nhi<|im_end|> ünïcödé 123"


@pytest.mark.parametrize("arch", ARCHS)
def test_the_same_tokenizer_as_autotokenizer_picks(tiny_models, arch):
    from transformers import AutoTokenizer

    from pdserve.common.tokenizer import load_tokenizer

    path = tiny_models(arch)
    ours, theirs = load_tokenizer(path), AutoTokenizer.from_pretrained(path, local_files_only=True)
    assert type(ours) is type(theirs)  # (a Qwen2 checkpoint's Qwen2Tokenizer, from its model_type)
    assert ours.encode(TEXT) == theirs.encode(TEXT) and ours.decode(ours.encode(TEXT)) == theirs.decode(
        theirs.encode(TEXT)
    )
    assert ours.get_added_vocab() == theirs.get_added_vocab() and ours.all_special_ids == theirs.all_special_ids


def test_a_llama_tokenizer_loads_without_the_llama_config_module(tiny_models):
    code = (
        "import sys; from pdserve.common.tokenizer import load_tokenizer; load_tokenizer(sys.argv[1]); "
        "print('transformers.models.llama.configuration_llama' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code, tiny_models("llama")], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "False"


HIDDEN = """
import json, sys
import torch
from pdserve.common.torch_free import transformers_without_torch
if sys.argv[2] == "late":
    import transformers  # already imported: the call must leave it as it is
transformers_without_torch()
from pdserve.common.tokenizer import load_tokenizer
from transformers.utils import is_torch_available
from safetensors.torch import save_file  # torch's own users still get the real torch
tok = load_tokenizer(sys.argv[1])
ids = tok.encode(sys.argv[3])
chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
print(json.dumps({"type": type(tok).__name__, "ids": ids, "text": tok.decode(ids), "chat": chat,
                  "special": tok.all_special_ids, "torch_for_transformers": is_torch_available(),
                  "torch_works": float(torch.ones(3).sum()), "torch_is_real": sys.modules["torch"] is torch}))
"""


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_a_server_process_tokenizes_with_transformers_kept_from_torch(tiny_models, arch):
    """A server's scheduler (torch imported) loads its tokenizer through a transformers that believes
    torch absent (common/torch_free.py transformers_without_torch): the tokenizer AutoTokenizer picks
    with torch, the same ids, text, chat template and special ids; torch stays usable."""
    import json

    from transformers import AutoTokenizer

    path = tiny_models(arch)
    theirs = AutoTokenizer.from_pretrained(path, local_files_only=True)
    # (late, once: transformers imported with torch before the call is left as it is)
    for when, torch_seen in (("first", False),) + ((("late", True),) if arch == "gpt2" else ()):
        run = subprocess.run([sys.executable, "-c", HIDDEN, path, when, TEXT], capture_output=True, text=True)
        assert run.returncode == 0, run.stderr[-2000:]
        got = json.loads(run.stdout.strip().splitlines()[-1])
        assert got["torch_for_transformers"] is torch_seen
        assert got["torch_works"] == 3.0 and got["torch_is_real"]
        assert got["type"] == type(theirs).__name__ and got["ids"] == theirs.encode(TEXT)
        assert got["text"] == theirs.decode(theirs.encode(TEXT)) and got["special"] == theirs.all_special_ids
        want_chat = theirs.apply_chat_template(
            [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
        )
        assert got["chat"] == want_chat
