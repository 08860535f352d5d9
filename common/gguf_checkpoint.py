"""GGUF checkpoints (llama.cpp's one-file format), seen as a Hugging Face checkpoint directory.

`--model-path` may name a .gguf file, or a directory holding exactly one and no config.json. The
rest of pdserve asks a checkpoint three things, answered from the file's metadata:

    hf_config(path)              the fields config.json would hold, so the model code is unchanged
    load_tokenizer(path)         the tokenizer and chat template (common/gguf_tokenizer.py)
    eos_token_ids(path, tok)     the ids llama.cpp stops at

The weights (dequantized, under the Hugging Face names and layouts): engine/models/gguf_weights.py.
Metadata and tokenizer are read once per path and process (the router and the engine ask often), and
parsed or converted once per host: both are kept in the cache (common/cache.py).
"""

from __future__ import annotations

import contextlib
import functools
import glob
import hashlib
import json
import logging
import os
import pathlib
import tempfile
from dataclasses import dataclass
from typing import Any

from pdserve.common.cache import cache_root

log = logging.getLogger(__name__)

# general.architecture -> config.json's `architectures` entry (llama may be Mistral: _decoder_config).
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gpt2": "GPT2LMHeadModel",
}
# llama.cpp's end-of-generation ids, in the order they are listed.
EOS_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
_REQUIRED = object()


def gguf_file(model_path: str) -> str | None:
    """The .gguf file `model_path` names (itself, or the only *.gguf of a directory without a
    config.json); None for anything else. ValueError for a directory of several .gguf files."""
    if os.path.isfile(model_path) and model_path.lower().endswith(".gguf"):
        return os.path.abspath(model_path)  # one spelling per file: the caches below are keyed by it
    if not os.path.isdir(model_path) or os.path.exists(os.path.join(model_path, "config.json")):
        return None
    found = sorted(glob.glob(os.path.join(glob.escape(model_path), "*.gguf")))
    if len(found) > 1:
        names = ", ".join(os.path.basename(f) for f in found)
        raise ValueError(
            f"--model-path {model_path!r} holds {len(found)} .gguf files ({names}): name one "
            "(a split GGUF must first be merged: llama-gguf-split --merge)"
        )
    return os.path.abspath(found[0]) if found else None


@dataclass(frozen=True)
class GGUFInfo:
    """A GGUF file's metadata and tensor directory (no tensor data but RoPE's frequency factors): all the
    server needs of the file but the weights' bytes, which it maps itself."""

    path: str
    metadata: dict[str, Any]  # key -> value; the tokenizer's arrays as their lengths
    tensors: dict[str, tuple[tuple[int, ...], str]]  # name -> (shape in torch's order, ggml type name)
    rope_freqs: tuple[float, ...] | None  # llama.cpp's `rope_freqs` (Llama 3 RoPE scaling), if any
    offsets: dict[str, int]  # name -> where its data starts in the file (engine/models/gguf_weights.py)
    byte_order: str  # gguf's: "I" the host's, "S" swapped


@functools.lru_cache(maxsize=8)
def read_info(path: str) -> GGUFInfo:
    """GGUF file `path`'s metadata and tensor directory, read once per process, and parsed once per host.

    NOTE why a host cache: gguf's reader parses the tokenizer's arrays string by string, 2.3 s for
    SmolLM2's 49k vocabulary, in each process that asks (a server's front end, its scheduler and its
    weights, the router). Its JSON form in the cache (common/cache.py: gguf-info/) loads in milliseconds; it is keyed
    like the converted tokenizer (path, size, modification time, gguf's version) and written whole or
    not at all (a temporary file renamed into place)."""
    saved = _saved_info_file(path)
    try:
        return _info_from_json(path, json.loads(saved.read_text()))
    except FileNotFoundError:
        pass
    except (OSError, ValueError, KeyError, TypeError) as e:  # a damaged entry: read the file again
        log.warning("cannot load the saved GGUF metadata %s (%s): reading %s again", saved, e, path)
    info = _parse_info(path)
    _save_info(info, saved)
    return info


def _parse_info(path: str) -> GGUFInfo:
    import numpy as np
    from gguf import GGUFReader, GGUFValueType
    from gguf.quants import dequantize

    reader = GGUFReader(path)  # NOTE: ~2 s for a 50k vocabulary (its strings are parsed one by one)
    metadata: dict[str, Any] = {}
    for key, field in reader.fields.items():
        kind = field.types[0] if field.types else None
        if kind == GGUFValueType.ARRAY and key.startswith("tokenizer."):
            metadata[key] = len(field.data)  # transformers reads the vocabulary itself
        elif kind == GGUFValueType.FLOAT32:
            # The float32 the converter stored, as the value it was written from (9.99999975e-06 -> 1e-05).
            metadata[key] = float(str(np.float32(field.contents())))
        else:
            metadata[key] = field.contents()
    # NOTE: ggml lists dimensions innermost first ([in, out] for a weight): reversed, torch's order.
    tensors = {t.name: (tuple(int(n) for n in reversed(t.shape)), t.tensor_type.name) for t in reader.tensors}
    rope_freqs = None
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":  # a vector of head_dim / 2, F32
            rope_freqs = tuple(dequantize(t.data, t.tensor_type).reshape(-1).tolist())
    offsets = {t.name: int(t.data_offset) for t in reader.tensors}
    return GGUFInfo(path, metadata, tensors, rope_freqs, offsets, reader.byte_order)


def _saved_info_file(path: str) -> pathlib.Path:
    from importlib.metadata import version

    st = os.stat(path)
    key = f"{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}|gguf {version('gguf')}|info 2"
    return cache_root() / "gguf-info" / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"


def _info_from_json(path: str, saved: dict) -> GGUFInfo:
    tensors = {name: (tuple(shape), kind) for name, (shape, kind) in saved["tensors"].items()}
    rope_freqs = saved["rope_freqs"]
    rope_freqs = tuple(rope_freqs) if rope_freqs is not None else None
    return GGUFInfo(path, saved["metadata"], tensors, rope_freqs, saved["offsets"], saved["byte_order"])


def _save_info(info: GGUFInfo, saved: pathlib.Path) -> None:
    """Best effort, as the converted tokenizer's: without it the next process parses the file again."""
    try:
        # (JSON keeps str, int, float (repr: exact), bool and lists; metadata of any other kind is not saved)
        fields = ("metadata", "tensors", "rope_freqs", "offsets", "byte_order")
        text = json.dumps({name: getattr(info, name) for name in fields})
    except (TypeError, ValueError) as e:
        log.warning("not caching %s's metadata: %s", info.path, e)
        return
    tmp = None
    try:
        saved.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=saved.parent, prefix=".writing-")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, saved)  # atomic: a reader sees the old entry, none, or this one whole
        tmp = None
    except OSError as e:
        log.warning("cannot cache %s's metadata in %s: %s", info.path, saved.parent, e)
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


@functools.cache
def dequantizable_types() -> tuple[str, ...]:
    """The ggml types gguf.quants.dequantize reads: each tried on one block of zeros."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    names = []
    for qtype in GGMLQuantizationType:
        block_bytes = GGML_QUANT_SIZES[qtype][1]
        try:
            dequantize(np.zeros((1, block_bytes), np.uint8), qtype)
        except NotImplementedError:
            continue
        names.append(qtype.name)
    return tuple(names)


def hf_config(path: str) -> dict:
    """config.json's fields for the model in GGUF file `path` (a new dict each call).

    ValueError for an architecture, a RoPE variant or a tensor type pdserve cannot serve."""
    info = read_info(path)
    arch = info.metadata.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"{path}: GGUF architecture {arch!r} is not supported; supported: "
            f"{', '.join(sorted(ARCHITECTURES))} (Mistral is llama in GGUF)"
        )
    unsupported = sorted({kind for _, kind in info.tensors.values()} - set(dequantizable_types()))
    if unsupported:
        raise ValueError(
            f"{path}: GGUF tensor type(s) {', '.join(unsupported)} cannot be dequantized; "
            f"supported: {', '.join(dequantizable_types())}"
        )
    config = _gpt2_config(info) if arch == "gpt2" else _decoder_config(info, arch)
    for name, key in (
        ("bos_token_id", "tokenizer.ggml.bos_token_id"),
        ("eos_token_id", "tokenizer.ggml.eos_token_id"),
        ("pad_token_id", "tokenizer.ggml.padding_token_id"),
    ):
        if key in info.metadata:
            config[name] = info.metadata[key]
    return config


def _key(info: GGUFInfo, name: str, default: Any = _REQUIRED) -> Any:
    if name in info.metadata:
        return info.metadata[name]
    if default is _REQUIRED:
        raise ValueError(f"{info.path}: GGUF metadata lacks {name!r}")
    return default


def _vocab_size(info: GGUFInfo) -> int:
    """The embedding's rows: what the weights hold (the tokenizer may list fewer)."""
    if "token_embd.weight" not in info.tensors:
        raise ValueError(f"{info.path}: no token_embd.weight tensor")
    return info.tensors["token_embd.weight"][0][0]


def _decoder_config(info: GGUFInfo, arch: str) -> dict:
    """Llama, Mistral, Qwen2 and Qwen3 (common/engine/models/llama.py)."""

    def key(name: str, default: Any = _REQUIRED) -> Any:
        return _key(info, f"{arch}.{name}", default)

    hidden, heads = key("embedding_length"), key("attention.head_count")
    kv_heads = key("attention.head_count_kv", heads)
    if not isinstance(kv_heads, int):
        raise ValueError(f"{info.path}: per-layer KV head counts are not supported")
    head_dim = key("attention.key_length", hidden // heads)
    if key("rope.dimension_count", head_dim) != head_dim:
        raise ValueError(
            f"{info.path}: partial rotary ({key('rope.dimension_count')} of {head_dim} dims) is not supported"
        )
    theta = key("rope.freq_base", 10000.0)
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    scaling = key("rope.scaling.type", "none")
    if scaling == "linear":
        rope.update(rope_type="linear", factor=key("rope.scaling.factor"))
    elif scaling != "none":
        raise ValueError(f"{info.path}: RoPE scaling {scaling!r} is not supported (none, linear, rope_freqs)")
    if info.rope_freqs is not None:
        # Llama 3's scaling, as llama.cpp stores it: each frequency divided by its factor.
        rope["freq_factors"] = list(info.rope_freqs)
    # llama.cpp converts Mistral as llama; transformers tells them apart by the name.
    window = key("attention.sliding_window", None) if arch == "llama" else None
    mistral = arch == "llama" and (bool(window) or "mistral" in str(info.metadata.get("general.name", "")).lower())
    names = info.tensors
    config = {
        "architectures": ["MistralForCausalLM" if mistral else ARCHITECTURES[arch]],
        "model_type": "mistral" if mistral else arch,
        "vocab_size": _vocab_size(info),
        "hidden_size": hidden,
        "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon"),
        "max_position_embeddings": key("context_length"),
        "rope_theta": theta,
        "rope_parameters": rope,
        # llama.cpp writes `output` only when the LM head is not the embedding
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": arch == "qwen2" or "blk.0.attn_q.bias" in names,
        "mlp_bias": "blk.0.ffn_up.bias" in names,
    }
    if window:
        config["sliding_window"] = window
    return config


def _gpt2_config(info: GGUFInfo) -> dict:
    def key(name: str, default: Any = _REQUIRED) -> Any:
        return _key(info, f"gpt2.{name}", default)

    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": _vocab_size(info),
        "n_embd": key("embedding_length"),
        "n_layer": key("block_count"),
        "n_head": key("attention.head_count"),
        "n_inner": key("feed_forward_length"),
        "n_positions": key("context_length"),
        "layer_norm_epsilon": key("attention.layer_norm_epsilon"),
        "activation_function": "gelu_new",
        "scale_attn_weights": True,
        # NOTE: llama.cpp writes `output` as a copy of the embedding; the model always ties, so the
        # head is token_embd's values (llama.cpp's differ where `output` was quantized to another type).
        "tie_word_embeddings": True,
    }


def eos_token_ids(path: str, tokenizer) -> tuple[int, ...]:
    """llama.cpp's eos, end-of-turn and end-of-message ids, then the tokenizer's eos."""
    metadata = read_info(path).metadata
    ids = [metadata[key] for key in EOS_KEYS if key in metadata]
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return tuple(dict.fromkeys(ids))
