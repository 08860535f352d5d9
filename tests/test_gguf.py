"""GGUF checkpoints: greedy tokens equal transformers' on the same file.

Tiny models (common/tiny_model.py) are written as llama.cpp writes them (tests/tiny_gguf.py: names,
Q/K permutation, metadata), F32 and Q8_0; transformers' own GGUF reader loads each file, which
checks the writer, and the engine must then give transformers' greedy tokens on it. The real
SmolLM2-135M-Instruct Q4_1 file (tests/real_model.py) is checked the same way on chat prompts, to its
<|im_end|>, through `pdserve run-batch`, and what the router reads from it.
"""

import dataclasses
import json
import random
from pathlib import Path
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch

from pdserve.common.tiny_model import ARCHS, IM_END_ID, make_tiny_model
from pdserve.common.types import SamplingParams
from tests.tiny_gguf import write_gguf

QTYPES = ("F32", "Q8_0")
# Tiny checkpoints changed where transformers' GGUF reader (5.x, its legacy path for these
# architectures) cannot rebuild the model from the file:
TRANSFORMERS_GGUF_OVERRIDES = {
    # it ignores `rope_freqs` (Llama 3's RoPE scaling): plain RoPE here, rope_freqs tested on its own
    "llama": {"rope_scaling": None, "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}},
    # it maps no attention.key_length for qwen3 and takes Qwen3Config's head_dim, 128 (real Qwen3's)
    "qwen3": {"head_dim": 128},
    # it ignores feed_forward_length for gpt2: n_inner = 4 * n_embd (real GPT-2's)
    "gpt2": {"n_inner": 256},
}
# Prompt + output stay under Mistral's 48-token window: transformers does not read the window from
# the file (and takes Mistral for Llama: it looks for "mistral" in a list of names).
PROMPT_LENS = (1, 7, 20, 30)
MAX_NEW = 10


@pytest.fixture(scope="module")
def tiny_ggufs(tmp_path_factory):
    """(arch, qtype) -> (checkpoint directory, .gguf path: alone in its directory), on first use."""
    root = tmp_path_factory.mktemp("gguf")
    built = {}

    def get(arch: str, qtype: str) -> tuple[str, str]:
        if (arch, qtype) not in built:
            checkpoint = make_tiny_model(root / arch, arch, 0, TRANSFORMERS_GGUF_OVERRIDES.get(arch))
            folder = root / f"{arch}-{qtype}"
            folder.mkdir()
            path = write_gguf(checkpoint, folder / f"tiny-{arch}.{qtype}.gguf", gguf.GGMLQuantizationType[qtype])
            built[arch, qtype] = str(checkpoint), str(path)
        return built[arch, qtype]

    return get


def prompts(n_lens=PROMPT_LENS, vocab=512, seed=0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[0] + [rng.randrange(5, vocab) for _ in range(n - 1)] for n in n_lens]


def hf_greedy(model, ids: list[list[int]], max_new: int, eos: tuple[int, ...]) -> list[list[int]]:
    outs = []
    for prompt in ids:
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=max_new,
                do_sample=False,
                eos_token_id=list(eos),
                pad_token_id=eos[0],
            )
        outs.append(out[0, len(prompt) :].tolist())
    return outs


def hf_from_gguf(path: str):
    from transformers import AutoModelForCausalLM

    path = Path(path)
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


def engine_greedy(engine, ids: list[list[int]], max_new: int) -> list[list[int]]:
    outs = engine.generate(ids, [SamplingParams(max_new_tokens=max_new, temperature=0) for _ in ids])
    assert engine.is_idle(), f"KV leaked: {engine.stats()}"
    return [o.output_ids for o in outs]


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_gguf_greedy_matches_transformers_on_the_same_file(tiny_ggufs, arch, qtype):
    from pdserve.common.config import read_hf_config
    from pdserve.common.engine.engine import Engine

    checkpoint, path = tiny_ggufs(arch, qtype)
    expected_arch = json.loads((Path(checkpoint) / "config.json").read_text())["architectures"]
    assert read_hf_config(path)["architectures"] == expected_arch
    engine = Engine(model_path=path, device="cpu", max_total_tokens=2048)
    assert engine.eos_token_ids == (1, IM_END_ID), "eos, then llama.cpp's end-of-turn"
    ids = prompts()
    assert engine_greedy(engine, ids, MAX_NEW) == hf_greedy(hf_from_gguf(path), ids, MAX_NEW, engine.eos_token_ids)


@pytest.mark.parametrize("arch", ARCHS)
def test_an_f32_gguf_loads_the_exact_weights_of_its_checkpoint_and_each_rank_its_slices(tiny_ggufs, arch):
    """Against the safetensors it was written from, not transformers: names, permutation, layouts;
    then rank 1 of 2 (no collectives run while loading) of the Q8_0 file against the whole one."""
    from pdserve.common.engine.models.loader import load_model
    from pdserve.common.engine.tp import TPGroup

    checkpoint, path = tiny_ggufs(arch, "F32")
    ours, reference = load_model(path, torch.float32, "cpu"), load_model(checkpoint, torch.float32, "cpu")
    assert list(ours.state_dict()) == list(reference.state_dict())
    for name, tensor in reference.state_dict().items():
        assert torch.equal(ours.state_dict()[name], tensor), name
    _, quantized = tiny_ggufs(arch, "Q8_0")
    whole = dict(load_model(quantized, torch.float32, "cpu").named_parameters())
    rank1 = dict(load_model(quantized, torch.float32, "cpu", TPGroup(1, 2, torch.device("cpu"))).named_parameters())
    if arch == "gpt2":  # q, k, v blocks of 64 each: rank 1 has rows 32..64 of each; c_proj its input columns
        w = whole["transformer.h.0.attn.c_attn.weight"]
        assert torch.equal(rank1["transformer.h.0.attn.c_attn.weight"], torch.cat([w[32:64], w[96:128], w[160:192]]))
        assert torch.equal(
            rank1["transformer.h.0.attn.c_proj.weight"], whole["transformer.h.0.attn.c_proj.weight"][:, 32:]
        )
        assert torch.equal(rank1["transformer.wte.weight"], whole["transformer.wte.weight"][256:])
        return
    q_rows = 2 * (128 if arch == "qwen3" else 16)  # two of the four heads
    layer = "model.layers.1."
    assert torch.equal(rank1[layer + "self_attn.q_proj.weight"], whole[layer + "self_attn.q_proj.weight"][q_rows:])
    assert torch.equal(
        rank1[layer + "self_attn.k_proj.weight"], whole[layer + "self_attn.k_proj.weight"][q_rows // 2 :]
    )
    assert torch.equal(rank1[layer + "self_attn.o_proj.weight"], whole[layer + "self_attn.o_proj.weight"][:, q_rows:])
    assert torch.equal(rank1[layer + "mlp.down_proj.weight"], whole[layer + "mlp.down_proj.weight"][:, 64:])


def test_llama3_rope_freqs_give_the_checkpoints_tokens(tiny_models, tmp_path):
    """The tiny llama's RoPE is Llama 3's: llama.cpp stores it as `rope_freqs`, which transformers'
    GGUF reader ignores, so the reference is transformers on the safetensors checkpoint."""
    from transformers import AutoModelForCausalLM

    from pdserve.common.config import read_hf_config
    from pdserve.common.engine.engine import Engine

    checkpoint = tiny_models("llama")
    path = write_gguf(checkpoint, tmp_path / "llama3.gguf")
    assert len(read_hf_config(str(path))["rope_parameters"]["freq_factors"]) == 8
    ids = prompts((1, 30, 90, 200), seed=1)  # (without the factors, all four differ)
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    engine = Engine(model_path=str(path), device="cpu", max_total_tokens=2048)
    assert engine_greedy(engine, ids, MAX_NEW) == hf_greedy(hf, ids, MAX_NEW, engine.eos_token_ids)


def test_model_path_names_a_gguf_file_or_a_directory_holding_exactly_one(tiny_ggufs, tmp_path):
    from pdserve.common.config import check_model_path, read_hf_config
    from pdserve.common.gguf_checkpoint import gguf_file

    checkpoint, path = tiny_ggufs("qwen2", "Q8_0")
    folder = str(tmp_path / "one")
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "model.gguf").write_bytes(open(path, "rb").read())
    assert gguf_file(path) == path and gguf_file(folder) == f"{folder}/model.gguf"
    assert gguf_file(checkpoint) is None, "a Hugging Face directory stays one"
    assert read_hf_config(folder) == read_hf_config(path)
    check_model_path(folder)
    (tmp_path / "one" / "other.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match="holds 2 .gguf files"):
        check_model_path(folder)
    with pytest.raises(ValueError, match="has no config.json and is not a .gguf file"):
        check_model_path(str(tmp_path))


def test_an_unsupported_architecture_or_tensor_type_is_a_clear_error(tmp_path):
    from pdserve.common.config import EngineConfig

    def write(name: str, arch: str, qtype: gguf.GGMLQuantizationType) -> str:
        writer = gguf.GGUFWriter(str(tmp_path / name), arch)
        block_bytes = gguf.GGML_QUANT_SIZES[qtype][1]
        writer.add_tensor(
            "token_embd.weight", np.zeros((4, block_bytes), np.uint8), raw_dtype=qtype
        )  # 4 rows of a block
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return str(tmp_path / name)

    with pytest.raises(
        ValueError, match=r"architecture 'falcon' is not supported; supported: gpt2, llama, qwen2, qwen3"
    ):
        EngineConfig(model_path=write("falcon.gguf", "falcon", gguf.GGMLQuantizationType.Q8_0), device="cpu").resolve()
    with pytest.raises(
        ValueError, match=r"tensor type\(s\) Q8_1 cannot be dequantized; supported: F32, F16, Q4_0.*Q8_0.*Q6_K"
    ):
        EngineConfig(model_path=write("q81.gguf", "llama", gguf.GGMLQuantizationType.Q8_1), device="cpu").resolve()


def test_a_tp2_engine_on_a_quantized_gguf_gives_transformers_tokens(tiny_ggufs):
    from pdserve.common.engine.engine import Engine

    _, path = tiny_ggufs("llama", "Q8_0")
    engine = Engine(model_path=path, device="cpu", tp_size=2, max_total_tokens=2048)
    try:
        ids = prompts(seed=2)
        assert engine_greedy(engine, ids, MAX_NEW) == hf_greedy(hf_from_gguf(path), ids, MAX_NEW, engine.eos_token_ids)
    finally:
        engine.close()


# ------------------------------------------------------------------------------------------------
# SmolLM2-135M-Instruct, Q4_1

QUESTIONS = ("What is the capital of France?", "Name three primary colors.", "What is 2 + 2?")
SMOL_ENGINE = ["--device", "cpu", "--context-length", "1024", "--max-total-tokens", "2048"]


def test_smollm2_greedy_chat_through_run_batch_matches_transformers_to_its_eos(smollm2, tmp_path):
    """`pdserve run-batch --model-path DIR` (the package directory holding the one .gguf), in this
    process so the tokenizer is built once: the chats as token ids (exact tokens) and as messages
    (the GGUF's chat template); then what the router reads from the same file."""
    from pdserve.common.cli import main
    from pdserve.router.app import Router
    from pdserve.router.config import RouterConfig

    path, hf, tokenizer = smollm2
    assert tokenizer.convert_ids_to_tokens(tokenizer.eos_token_id) == "<|im_end|>"
    chats = []  # (prompt ids, transformers' greedy output ids)
    for question in QUESTIONS:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        chats.append((ids, hf_greedy(hf, [ids], 64, (tokenizer.eos_token_id,))[0]))
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = []
    for i, (question, (ids, _)) in enumerate(zip(QUESTIONS, chats)):
        completion = {"prompt": ids, "max_tokens": 64, "temperature": 0, "return_token_ids": True}
        chat = {"messages": [{"role": "user", "content": question}], "max_tokens": 64, "temperature": 0}
        lines.append({"custom_id": f"ids{i}", "method": "POST", "url": "/v1/completions", "body": completion})
        lines.append({"custom_id": f"chat{i}", "method": "POST", "url": "/v1/chat/completions", "body": chat})
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert (
        main(["run-batch", "-i", str(src), "-o", str(dst), "--model-path", str(Path(path).parent), *SMOL_ENGINE]) == 0
    )
    results = {r["custom_id"]: r["response"] for r in map(json.loads, dst.read_text().splitlines())}
    for i, (_, expected) in enumerate(chats):
        [completion] = results[f"ids{i}"]["body"]["choices"]
        [chat] = results[f"chat{i}"]["body"]["choices"]
        assert completion["token_ids"] == expected and expected[-1] == tokenizer.eos_token_id, tokenizer.decode(
            expected
        )
        assert chat["finish_reason"] == "stop" and chat["message"]["content"] == tokenizer.decode(
            expected, skip_special_tokens=True
        )
    router = Router(RouterConfig(path, ("127.0.0.1:1",), ("127.0.0.1:2",)))
    assert (router.eos, router.context_len, router.vocab_size) == ((tokenizer.eos_token_id,), 8192, 49152)
    assert router.tokenizer is tokenizer, "built once per process"


def test_a_ggufs_tokenizer_is_converted_once_and_loads_the_same_from_the_cache(tiny_ggufs, tmp_path, monkeypatch):
    import transformers

    from pdserve.common import gguf_tokenizer

    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    _, path = tiny_ggufs("llama", "Q8_0")
    gguf_tokenizer.load_tokenizer.cache_clear()
    try:
        converted = gguf_tokenizer.load_tokenizer(path)
        [saved] = (tmp_path / "tokenizers").iterdir()
        assert (saved / "tokenizer.json").is_file()
        gguf_tokenizer.load_tokenizer.cache_clear()
        convert = transformers.AutoTokenizer.from_pretrained

        def no_conversion(*args, **kwargs):
            assert "gguf_file" not in kwargs, "converted again: the cache was not used"
            return convert(*args, **kwargs)

        monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", no_conversion)
        cached = gguf_tokenizer.load_tokenizer(path)
    finally:
        gguf_tokenizer.load_tokenizer.cache_clear()
    texts = ["Hello world", "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n", " spaces  and\ttabs ", "é 日本 🙂"]
    assert [cached(t).input_ids for t in texts] == [converted(t).input_ids for t in texts]
    ids = converted(texts[1]).input_ids
    assert cached.decode(ids) == converted.decode(ids) and cached.decode(ids, skip_special_tokens=True) == (
        converted.decode(ids, skip_special_tokens=True)
    )
    assert cached.chat_template == converted.chat_template and len(cached) == len(converted)
    assert cached.all_special_tokens == converted.all_special_tokens and cached.eos_token_id == converted.eos_token_id
    messages = [{"role": "user", "content": "hi"}]
    assert cached.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        converted.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    )


def test_a_ggufs_metadata_is_parsed_once_and_a_changed_or_damaged_entry_is_read_again(
    tiny_models, tmp_path, monkeypatch
):
    """read_info's host cache (gguf-info/): what it returns from the cache is what parsing the file gives,
    floats, lists and Llama 3's rope_freqs included; a rewritten file or a damaged entry is parsed again."""
    import os

    from pdserve.common import gguf_checkpoint

    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "cache"))
    path = str(write_gguf(tiny_models("llama"), tmp_path / "llama3.gguf"))
    parses = []
    parse = gguf_checkpoint._parse_info
    monkeypatch.setattr(gguf_checkpoint, "_parse_info", lambda p: parses.append(p) or parse(p))

    def read() -> gguf_checkpoint.GGUFInfo:
        gguf_checkpoint.read_info.cache_clear()  # (the per-process cache above the host's)
        return gguf_checkpoint.read_info(path)

    try:
        parsed = read()
        [saved] = (tmp_path / "cache" / "gguf-info").iterdir()
        cached = read()
        assert parses == [path] and cached == parsed and cached.rope_freqs is not None
        assert {type(v) for v in cached.metadata.values()} >= {str, int, float}
        saved.write_text(saved.read_text()[:-20])  # damaged: parsed again and saved whole
        assert read() == parsed and len(parses) == 2 and read() == parsed and len(parses) == 2
        stat = os.stat(path)
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # the file changed: a new entry
        assert read() == parsed and len(parses) == 3
        assert len(list((tmp_path / "cache" / "gguf-info").iterdir())) == 2, "no temporary file left"
    finally:
        gguf_checkpoint.read_info.cache_clear()


@pytest.mark.parametrize("qtype", ["F32", "F16", "Q8_0", "Q4_1"])
def test_the_weights_map_the_same_bytes_gguf_s_reader_reads(tiny_models, tmp_path, monkeypatch, qtype):
    """file_tensors (offsets from the host-cached metadata, the file mapped here) against gguf's own
    reader: every tensor's type, shape, dtype and values; and a file in the other byte order goes
    through the reader."""
    from pdserve.common import gguf_checkpoint
    from pdserve.common.engine.models import gguf_weights

    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "cache"))
    path = str(write_gguf(tiny_models("llama"), tmp_path / f"llama3.{qtype}.gguf", gguf.GGMLQuantizationType[qtype]))
    read_info = gguf_checkpoint.read_info
    read_info.cache_clear()
    try:
        read_info(path)  # parsed and saved; the next process reads the cache
        read_info.cache_clear()
        ours = {name: (kind, shape, data) for name, kind, shape, data in gguf_weights.file_tensors(path)}
        theirs = gguf.GGUFReader(path).tensors
        assert list(ours) == [t.name for t in theirs] and any(t.tensor_type.name == qtype for t in theirs)
        for t in theirs:
            kind, shape, data = ours[t.name]
            assert kind == t.tensor_type and shape == tuple(int(n) for n in reversed(t.shape))
            assert data.dtype == t.data.dtype and data.shape == t.data.shape and np.array_equal(data, t.data)
        swapped = dataclasses.replace(read_info(path), byte_order="S")
        monkeypatch.setattr(gguf_checkpoint, "read_info", lambda p: swapped)
        read = []
        monkeypatch.setattr(gguf, "GGUFReader", lambda p: read.append(p) or SimpleNamespace(tensors=theirs))
        assert [name for name, *_ in gguf_weights.file_tensors(path)] == list(ours) and read == [path]
    finally:
        read_info.cache_clear()


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0", "Q4_K", "Q6_K"])
@pytest.mark.parametrize("rows", [1, 64, 150])
def test_many_rows_dequantize_to_what_gguf_gives(qtype, rows):
    """gguf_weights.dequantize_many views 64 rows as one (whole blocks either way): the values of gguf's
    own dequantize, remainder rows included."""
    from gguf.quants import dequantize

    from pdserve.common.engine.models.gguf_weights import dequantize_many

    kind = gguf.GGMLQuantizationType[qtype]
    block, type_size = gguf.GGML_QUANT_SIZES[kind]
    data = np.random.default_rng(0).integers(0, 256, (rows, 4 * type_size), dtype=np.uint8)
    np.testing.assert_array_equal(dequantize_many(data, kind), dequantize(data, kind))
    assert dequantize_many(data, kind).shape == (rows, 4 * block)
