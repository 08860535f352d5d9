"""A GGUF file's weights as the loader reads a safetensors file: the same keys, shapes and layouts.

    GGUFWeights(path, cfg): keys(), get_slice(key)[index], get_slice(key).get_shape(), get_tensor(key)

so the loader's one sharding path (loader._read) serves both. What llama.cpp's converter changed is
undone here, per tensor, as its rows are read (gguf.quants.dequantize, to float32):

    names      blk.N.attn_q.weight -> model.layers.N.self_attn.q_proj.weight, ... (tables below)
    rope rows  llama-arch Q and K (biases too) are permuted for llama.cpp's interleaved RoPE; Qwen's
               are not (transformers' LlamaTensorProcessor undoes the same)
    Conv1D     GPT-2's projections were transposed to [out, in]; shown again as HF's [in, out]

A shard reads only its rows of the file (the rows of a ggml tensor are its output features, and
quantization blocks never cross a row); a slice of the input features dequantizes the whole tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pdserve.common.engine.models.gpt2 import TRANSPOSED

# llama.cpp's tensor names -> Hugging Face's, per architecture family: the names outside the
# layers, then those of layer N ("blk.N.<leaf>" -> "<prefix>.N.<hf leaf>").
LLAMA_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
LLAMA_LAYER_PREFIX = "model.layers"
LLAMA_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
GPT2_NAMES = {
    "token_embd": "transformer.wte",
    "position_embd": "transformer.wpe",
    "output_norm": "transformer.ln_f",
    "output": "lm_head",
}
GPT2_LAYER_PREFIX = "transformer.h"
GPT2_LAYER_NAMES = {
    "attn_norm": "ln_1",
    "attn_qkv": "attn.c_attn",
    "attn_output": "attn.c_proj",
    "ffn_norm": "ln_2",
    "ffn_up": "mlp.c_fc",
    "ffn_down": "mlp.c_proj",
}
# Not weights: read into the config (Llama 3's RoPE frequency factors, gguf_checkpoint.py).
NOT_WEIGHTS = ("rope_freqs.weight",)


def hf_name(gguf_name: str, gpt2: bool) -> str:
    """The Hugging Face name of a llama.cpp tensor name; ValueError for one not in the tables."""
    names, prefix, layer_names = (
        (GPT2_NAMES, GPT2_LAYER_PREFIX, GPT2_LAYER_NAMES)
        if gpt2
        else (LLAMA_NAMES, LLAMA_LAYER_PREFIX, LLAMA_LAYER_NAMES)
    )
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in layer_names:
        return f"{prefix}.{parts[1]}.{layer_names[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in names:
        return f"{names[parts[0]]}.{parts[1]}"
    raise ValueError(
        f"GGUF tensor {gguf_name!r} is not one of the {'gpt2' if gpt2 else 'llama-family'} tensors pdserve knows"
    )


@dataclass(frozen=True)
class _Entry:
    data: np.ndarray  # the mapped file: its bytes (quantized, a row of blocks per row) or values, rows first
    ggml_type: object  # gguf's GGMLQuantizationType
    shape: tuple[int, ...]  # Hugging Face's shape
    rope_heads: int  # > 0: rows permuted by llama.cpp, this many heads of them
    conv1d: bool  # shown transposed: HF's [in, out] of the file's [out, in]

    @property
    def num_rows(self) -> int:
        """The file's rows: the output features (HF's dim 0, or dim 1 of a Conv1D)."""
        return self.shape[1] if self.conv1d else self.shape[0]


class GGUFWeights:
    """The tensors of GGUF file `path` under Hugging Face names; `cfg` is its hf_config."""

    def __init__(self, path: str, cfg: dict):
        gpt2 = cfg["architectures"][0] == "GPT2LMHeadModel"
        # NOTE: only llama-arch files are permuted: Mistral converts as llama, Qwen2/3 do not.
        permuted = cfg.get("model_type") in ("llama", "mistral")
        heads = cfg.get("num_attention_heads")
        rope_heads = {"attn_q": heads, "attn_k": cfg.get("num_key_value_heads") or heads}
        self.entries: dict[str, _Entry] = {}
        for name_in_file, ggml_type, file_shape, data in file_tensors(path):
            if name_in_file in NOT_WEIGHTS:
                continue
            name = hf_name(name_in_file, gpt2)
            leaf = name_in_file.split(".")[-2]
            conv1d = gpt2 and name.endswith(TRANSPOSED)
            self.entries[name] = _Entry(
                data,
                ggml_type,
                file_shape[::-1] if conv1d else file_shape,
                rope_heads[leaf] if permuted and leaf in rope_heads else 0,
                conv1d,
            )

    def keys(self) -> list[str]:
        return list(self.entries)

    def get_slice(self, key: str) -> "_Slice":
        return _Slice(self, key)

    def get_tensor(self, key: str) -> torch.Tensor:
        entry = self.entries[key]
        rows = self.rows(entry, 0, entry.num_rows)
        return rows.t() if entry.conv1d else rows

    def rows(self, entry: _Entry, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of the file's tensor (output features), dequantized, permutation undone."""
        data = entry.data
        if entry.rope_heads:
            head_dim = entry.num_rows // entry.rope_heads
            if start % head_dim or stop % head_dim:  # not whole heads: unpermute all, then cut
                return self.rows(entry, 0, entry.num_rows)[start:stop]
        packed_1d = data.ndim == 1 and data.dtype == np.uint8  # a quantized vector's data is bytes, not rows
        # NOTE: a plain array, not the reader's np.memmap: gguf dequantizes in groups of 16 rows, and every
        # slice of a memmap runs its Python __array_finalize__ (SmolLM2's Q4_1 load: 3.4 -> 2.4 s).
        values = dequantize_many(np.asarray(data if packed_1d else data[start:stop]), entry.ggml_type)
        if not values.flags.writeable:  # an F32 tensor's values are the read-only mapped file
            values = values.copy()
        values = torch.from_numpy(values.astype(np.float32, copy=False))
        if packed_1d:
            values = values[start:stop]
        if entry.rope_heads:
            values = unpermute_rope_rows(values, (stop - start) // head_dim)
        return values


ROWS_A_CALL = 64  # rows gguf's dequantize sees as one: its groups of 16 are then 1,024 rows


def dequantize_many(data: np.ndarray, ggml_type) -> np.ndarray:
    """gguf's dequantize of a quantized tensor's rows [rows, bytes a row], ROWS_A_CALL rows viewed as one.

    NOTE why: gguf dequantizes in groups of 16 rows, a numpy round trip each (SmolLM2's Q4_1: 12,816
    groups, 1.4 s of its 2.1 s); a row holds whole blocks, so ROWS_A_CALL consecutive rows' bytes are a
    row of whole blocks too, dequantized by the same code in a 64th of the calls. Memory stays bounded
    (a group is 1,024 rows). Values unchanged (tests/test_gguf.py)."""
    from gguf.quants import dequantize

    if data.ndim != 2 or data.dtype != np.uint8 or data.shape[0] < ROWS_A_CALL:
        return dequantize(data, ggml_type)
    rows, width = data.shape
    bulk = rows - rows % ROWS_A_CALL
    merged = dequantize(data[:bulk].reshape(bulk // ROWS_A_CALL, ROWS_A_CALL * width), ggml_type)
    values = merged.reshape(bulk, -1)
    if bulk == rows:
        return values
    return np.concatenate([values, dequantize(data[bulk:], ggml_type)])


# ggml types gguf's reader shows as values (the rest as bytes: blocks of quantized values, a row per row)
VALUE_TYPES = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16}
VALUE_TYPES |= {"I32": np.int32, "I64": np.int64}


def file_tensors(path: str):
    """(name, ggml type, shape in torch's order, data) for each tensor of GGUF file `path`: its data the
    mapped file's bytes, laid out as gguf's GGUFReader lays out a tensor's `data` (its _build_tensors).

    NOTE why not GGUFReader: it parses the whole metadata again (2.3 s for SmolLM2's vocabulary); the
    tensor directory and offsets come from read_info, parsed once per host. A file in the other byte
    order (rare: big-endian) goes through the reader, which swaps."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape

    from pdserve.common.gguf_checkpoint import read_info

    info = read_info(path)
    if info.byte_order != "I":
        from gguf import GGUFReader

        for t in GGUFReader(path).tensors:
            yield t.name, t.tensor_type, tuple(int(n) for n in reversed(t.shape)), t.data
        return
    file = np.memmap(path, mode="r")
    for name, (shape, kind) in info.tensors.items():
        ggml_type, start, count = GGMLQuantizationType[kind], info.offsets[name], int(np.prod(shape))
        if kind in VALUE_TYPES:
            dtype = np.dtype(VALUE_TYPES[kind])
            data = file[start : start + count * dtype.itemsize].view(dtype).reshape(shape)
        else:
            block_size, type_size = GGML_QUANT_SIZES[ggml_type]
            data = file[start : start + count * type_size // block_size].reshape(
                quant_shape_to_byte_shape(shape, ggml_type)
            )
        yield name, ggml_type, shape, data


class _Slice:
    """safetensors' slice object for one tensor: get_shape() and [index] in Hugging Face's layout."""

    def __init__(self, weights: GGUFWeights, key: str):
        self.weights, self.entry = weights, weights.entries[key]
        self.key = key

    def get_shape(self) -> list[int]:
        return list(self.entry.shape)

    def __getitem__(self, index: tuple[slice, ...]) -> torch.Tensor:
        row_dim = 1 if self.entry.conv1d else 0  # where the file's rows are in HF's layout
        rows = index[row_dim] if len(index) > row_dim else slice(None)
        others = [s for d, s in enumerate(index) if d != row_dim]
        if rows.step is None and all(s == slice(None) for s in others):
            start, stop, _ = rows.indices(self.entry.num_rows)
            block = self.weights.rows(self.entry, start, stop)
            return block.t() if self.entry.conv1d else block
        return self.weights.get_tensor(self.key)[index]


def unpermute_rope_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's `permute` of Q/K rows (weight or bias) for `n_head` whole heads.

    llama.cpp: w.reshape(n_head, 2, head_dim // 2, ...).swapaxes(1, 2): each head's two rotary halves
    interleaved (its RoPE pairs neighbours; transformers' rotate_half pairs i and i + head_dim/2)."""
    head_dim = w.shape[0] // n_head
    return w.reshape(n_head, head_dim // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
