"""The router's processes never import torch (common/torch_free.py), and tokenize as before.

- keep_torch_out() makes torch unimportable and transformers see none; once transformers has seen
  torch it leaves it be.
- A torch-free process's tokenizer gives transformers' own (built with torch) ids, chat-template
  text, decodes and special tokens, for every tiny architecture and for SmolLM2's GGUF, whose
  tokenizer the torch-free process has a child convert into the cache (or, where the cache cannot
  be written, into a temporary folder).
- `pdserve-router`, one process or a supervisor with workers, a fork server and a spare: no process
  of it maps torch's library once every worker has built its Router, and each that built one maps the
  tokenizers library (so the check cannot pass on a process that never loaded a tokenizer).
"""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from pdserve.bench.micro.router_memory import process_tree
from pdserve.common.ports import free_port
from pdserve.common.tiny_model import ARCHS

REPO = Path(__file__).resolve().parent.parent
TEXTS = [
    "Hello world",
    "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n",
    " spaces  and\ttabs \n\n",
    "é 日本 🙂 ünïcödé 123",
    "<|endoftext|><s></s><|bos|> trailing",
]
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 + 2? <|im_end|> ünï"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3 + 3?"},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


def tokenizer_facts(tokenizer) -> dict:
    """What the router asks of a tokenizer, as JSON: ids, chat-template text, decodes, special tokens."""
    chat = {}
    for generation_prompt in (False, True):
        for tools in (None, TOOLS):
            text = tokenizer.apply_chat_template(
                MESSAGES, tools=tools, add_generation_prompt=generation_prompt, tokenize=False
            )
            chat[f"generation_prompt={generation_prompt} tools={tools is not None}"] = [
                text,
                tokenizer.encode(text, add_special_tokens=False),
            ]
    ids = [tokenizer.encode(text) for text in TEXTS]
    return {
        "class": type(tokenizer).__name__,
        "ids": ids,
        "ids_without_special": [tokenizer(text, add_special_tokens=False).input_ids for text in TEXTS],
        "decoded": [[tokenizer.decode(i), tokenizer.decode(i, skip_special_tokens=True)] for i in ids],
        "tokens": [tokenizer.convert_ids_to_tokens(i) for i in ids],
        "chat": chat,
        "chat_template": tokenizer.chat_template,
        "size": len(tokenizer),
        "vocab": sorted(tokenizer.get_vocab().items()),
        "added": {str(i): [str(t), t.special] for i, t in tokenizer.added_tokens_decoder.items()},
        "special": [tokenizer.all_special_tokens, tokenizer.all_special_ids],
        "bos_eos_pad": [tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id],
    }


def run_python(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_torch_kept_out_is_not_importable_and_transformers_sees_none():
    code = (
        "from pdserve.common.torch_free import keep_torch_out, torch_kept_out\n"
        "keep_torch_out(); keep_torch_out()\n"
        "from transformers.utils import is_torch_available\n"
        "try:\n    import torch\nexcept ImportError:\n    torch = None\n"
        "print(torch_kept_out(), is_torch_available(), torch is None)"
    )
    assert run_python(code) == "True False True"


def test_torch_is_not_kept_out_once_transformers_has_seen_it():
    """(transformers would import torch later, and fail on the mark.)"""
    code = (
        "import transformers\n"
        "from pdserve.common.torch_free import keep_torch_out, torch_kept_out\n"
        "keep_torch_out()\n"
        "from transformers import AutoTokenizer\n"
        "print(torch_kept_out())"
    )
    assert run_python(code).splitlines()[-1] == "False"


TORCH_FREE = """
import json, sys
from pdserve.common.torch_free import keep_torch_out
keep_torch_out()
from pdserve.common.tokenizer import eos_token_ids, load_tokenizer
from tests.test_router_torch_free import tokenizer_facts
facts = {}
for path in sys.argv[1:]:
    tokenizer = load_tokenizer(path)
    facts[path] = {**tokenizer_facts(tokenizer), "eos": list(eos_token_ids(path, tokenizer))}
maps = open("/proc/self/maps").read()
print(json.dumps({"facts": facts, "torch": sys.modules["torch"] is not None or "libtorch" in maps}))
"""


def test_a_torch_free_process_tokenizes_as_transformers_with_torch(tiny_models, tmp_path):
    """(A fresh cache: the GGUF's tokenizer is converted by the torch-free process's child.)"""
    from transformers import AutoTokenizer

    from pdserve.common.tokenizer import eos_token_ids
    from tests.real_model import smollm2_gguf_path

    gguf = smollm2_gguf_path()
    paths = [tiny_models(arch) for arch in ARCHS] + [gguf]
    env = {**os.environ, "PDSERVE_CACHE": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", TORCH_FREE, *paths], cwd=REPO, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    torch_free = json.loads(out.stdout.splitlines()[-1])
    assert torch_free["torch"] is False
    assert list((tmp_path / "tokenizers").iterdir()), "the conversion was saved in the cache"
    for path in paths:
        folder, name = os.path.split(path)
        gguf_file = {"gguf_file": name} if path == gguf else {}
        theirs = AutoTokenizer.from_pretrained(folder if gguf_file else path, local_files_only=True, **gguf_file)
        expected = {**tokenizer_facts(theirs), "eos": list(eos_token_ids(path, theirs))}
        expected = json.loads(json.dumps(expected))  # (tuples as lists, as ours came)
        ours = torch_free["facts"][path]
        for key in expected:
            assert ours[key] == expected[key], f"{path}: {key}"


def test_a_torch_free_process_converts_a_gguf_where_the_cache_cannot_be_written(tiny_models, tmp_path):
    """(The conversion goes to a temporary folder, removed once loaded.)"""
    import gguf
    from transformers import AutoTokenizer

    from tests.tiny_gguf import write_gguf

    path = str(write_gguf(Path(tiny_models("llama")), tmp_path / "tiny.gguf", gguf.GGMLQuantizationType.F32))
    (tmp_path / "a-file").write_text("")
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {**os.environ, "PDSERVE_CACHE": str(tmp_path / "a-file" / "cache"), "TMPDIR": str(scratch)}
    out = subprocess.run([sys.executable, "-c", TORCH_FREE, path], cwd=REPO, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    ours = json.loads(out.stdout.splitlines()[-1])["facts"][path]
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="tiny.gguf", local_files_only=True)
    del ours["eos"]
    assert ours == json.loads(json.dumps(tokenizer_facts(theirs)))
    assert list(scratch.iterdir()) == []


def router_started(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/readiness", timeout=2) as r:
            body = r.read()
    except urllib.error.HTTPError as e:  # 503: no decode server answers (none is started)
        body = e.read()
    except OSError:
        return False
    return bool(json.loads(body).get("router_started"))


@pytest.mark.parametrize("model, workers", [("llama", 1), ("smollm2", 2)])
def test_no_router_process_imports_torch(tiny_models, tmp_path, model, workers):
    """A supervised router on a GGUF and a fresh cache: its supervisor has the tokenizer converted (a
    child, gone once the workers start) and neither it nor its fork server, workers or spare maps torch."""
    from tests.real_model import smollm2_gguf_path

    path = smollm2_gguf_path() if model == "smollm2" else tiny_models(model)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "pdserve.router.cli", "--model-path", path, "--port", str(port)]
    argv += ["--decode", f"127.0.0.1:{free_port()}", "--disagg-policy", "never", "--workers", str(workers)]
    log = tmp_path / "router.log"
    env = {**os.environ, "PDSERVE_CACHE": str(tmp_path / "cache")}
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 240
        while not router_started(url):
            assert proc.poll() is None, "router exited:\n" + log.read_text()
            assert time.monotonic() < deadline, "router not started:\n" + log.read_text()
            time.sleep(0.2)
        maps = {}
        for pid in process_tree(proc.pid):
            name = Path(f"/proc/{pid}/comm").read_text().strip()
            maps[pid, name] = Path(f"/proc/{pid}/maps").read_text()
        names = [name for _, name in maps]
        tokenizing = [key for key in maps if workers == 1 or key[1] in ("pdserve-worker", "pdserve-spare")]
        assert len(tokenizing) == (1 if workers == 1 else workers + 1), names
        for key in tokenizing:
            assert "tokenizers." in maps[key], f"{key} never loaded a tokenizer"
        assert [key for key, text in maps.items() if "libtorch" in text] == [], names
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
