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
when, text, paths = sys.argv[1], sys.argv[2], sys.argv[3:]
if when == "late":
    import transformers  # already imported: the call must leave it as it is
transformers_without_torch()
from pdserve.common.tokenizer import load_tokenizer
from transformers.utils import is_torch_available
from safetensors.torch import save_file  # torch's own users still get the real torch
facts = {}
for path in paths:
    tok = load_tokenizer(path)
    ids = tok.encode(text)
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    facts[path] = {"type": type(tok).__name__, "ids": ids, "text": tok.decode(ids), "chat": chat,
                   "special": tok.all_special_ids}
print(json.dumps({"facts": facts, "torch_for_transformers": is_torch_available(),
                  "torch_works": float(torch.ones(3).sum()), "torch_is_real": sys.modules["torch"] is torch}))
"""


def test_a_server_process_tokenizes_with_transformers_kept_from_torch(tiny_models):
    """A server's scheduler (torch imported) loads its tokenizer through a transformers that believes
    torch absent (common/torch_free.py transformers_without_torch): the tokenizer AutoTokenizer picks
    with torch, the same ids, text, chat template and special ids; torch stays usable. Where
    transformers was imported first, the call leaves it as it is."""
    import json

    from transformers import AutoTokenizer

    archs = {"first": ["llama", "qwen2", "gpt2"], "late": ["gpt2"]}
    for when, torch_seen in (("first", False), ("late", True)):
        paths = [tiny_models(arch) for arch in archs[when]]
        run = subprocess.run([sys.executable, "-c", HIDDEN, when, TEXT, *paths], capture_output=True, text=True)
        assert run.returncode == 0, run.stderr[-2000:]
        got = json.loads(run.stdout.strip().splitlines()[-1])
        assert got["torch_for_transformers"] is torch_seen
        assert got["torch_works"] == 3.0 and got["torch_is_real"]
        for path in paths:
            theirs, ours = AutoTokenizer.from_pretrained(path, local_files_only=True), got["facts"][path]
            assert ours["type"] == type(theirs).__name__ and ours["ids"] == theirs.encode(TEXT), path
            assert ours["text"] == theirs.decode(theirs.encode(TEXT)) and ours["special"] == theirs.all_special_ids
            want_chat = theirs.apply_chat_template(
                [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
            )
            assert ours["chat"] == want_chat, path
