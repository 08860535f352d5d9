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
