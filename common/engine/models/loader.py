"""Build a model from a Hugging Face checkpoint directory (config.json + *.safetensors) or a GGUF file.

With tensor parallelism each rank builds its shard of the model and reads only its slices of the
checkpoint (safetensors slices: `tp_shards` on the parallel layers, models/parallel.py). A GGUF file
is read through GGUFWeights (models/gguf_weights.py), which offers the same keys, shapes and slices;
what a whole load dequantized is saved for the next start, which reads it as safetensors
(models/gguf_cache.py).

FP8 weights (models/fp8.py, models/fp8_block.py): an FP8 checkpoint's layers become Fp8Linears (or
Fp8BlockLinears, block-wise checkpoints) before its tensors are read (float8 weights and their
scales load as they are; `weight_scale_inv` into `weight_scale`); `--quantization fp8` (fp8-block)
quantizes an unquantized checkpoint's linear layers once its weights are loaded.
"""

from __future__ import annotations

import functools
import importlib
import json
import math
import os
from typing import Iterator

import torch
from safetensors import safe_open

from pdserve.common.config import read_hf_config
from pdserve.common.engine.models import MODEL_REGISTRY, fp8, fp8_block, gguf_cache
from pdserve.common.engine.models.gguf_weights import GGUFWeights
from pdserve.common.engine.models.gpt2 import TRANSPOSED
from pdserve.common.engine.models.parallel import Shard
from pdserve.common.engine.models.staging import PinnedStaging
from pdserve.common.engine.tp import TPGroup
from pdserve.common.gguf_checkpoint import gguf_file
from pdserve.common.model_checks import KV_SCALE_SUFFIXES, checkpoint_quantization, checkpoint_weight_block

# Checkpoint entries that are not weights (cached buffers some exporters save).
# KV cache scales (engine/kv_scales.py reads them, with --kv-cache-dtype fp8_e4m3) are no weights.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias", *KV_SCALE_SUFFIXES)


def model_class(cfg: dict) -> type:
    archs = cfg.get("architectures") or []
    for arch in archs:
        if arch in MODEL_REGISTRY:
            module, name = MODEL_REGISTRY[arch].split(":")
            return getattr(importlib.import_module(module), name)
    raise ValueError(f"unsupported architectures {archs}; supported: {sorted(MODEL_REGISTRY)}")


def load_model(
    model_path: str,
    dtype: torch.dtype,
    device: torch.device | str,
    tp: TPGroup | None = None,
    quantization: str = "",
    fp8_lm_head: bool = False,
) -> torch.nn.Module:
    """The model (this rank's shard of it with tp), its weights loaded, in eval mode.
    `quantization` "fp8" / "fp8-block": FP8 linear layers, per-channel / 128 x 128 block scales (an
    FP8 checkpoint is served in its own FP8 form whatever it says)."""
    cfg = read_hf_config(model_path)
    cls = model_class(cfg)
    if tp is None:
        tp = TPGroup.single(torch.device(device))
    fp8_checkpoint = checkpoint_quantization(cfg) != ""
    weight_block = checkpoint_weight_block(cfg)
    if (weight_block or quantization == "fp8-block") and tp.size > 1:
        raise ValueError("block-wise FP8 linear layers are not tensor-parallel yet: use --tp-size 1")
    with torch.device("meta"):
        # NOTE: cast while on meta: Module.to(dtype) casts every floating parameter, float8 ones too.
        model = cls(cfg, tp).to(dtype)
    if weight_block:
        empty = functools.partial(fp8_block.Fp8BlockLinear.empty_like, block=weight_block)
        fp8.use_fp8_linears(model, _fp8_layers(model_path, cfg), empty)
    elif fp8_checkpoint:
        fp8.use_fp8_linears(model, _fp8_layers(model_path, cfg))
    # NOTE: not Module.to_empty: its empty_like on meta tensors runs through torch's Python references,
    # whose first use imports sympy (0.4 s of every server's start-up). Same storage, by shape and dtype.
    model = model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    model.tie_weights()
    _load_weights(model, model_path, cfg, dtype, save_gguf=tp.size == 1)
    if quantization and not fp8_checkpoint:
        block = quantization == "fp8-block"
        fp8.quantize_linears(model, fp8_block.Fp8BlockLinear.quantize if block else fp8.Fp8Linear.quantize)
    if fp8_lm_head:
        model.lm_head.fp8_logits = fp8.Fp8Logits(model.lm_head)
    # Buffers (RoPE inverse frequencies) are not in the checkpoint: compute them for real.
    for module in model.modules():
        if hasattr(module, "init_buffers"):
            module.init_buffers()
    return model.eval()


def _checkpoint_files(model_path: str) -> list[str]:
    index = os.path.join(model_path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(model_path, s) for s in shards]
    single = os.path.join(model_path, "model.safetensors")
    if os.path.exists(single):
        return [single]
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {model_path}")


def checkpoint_sources(model_path: str, cfg: dict, dtype: torch.dtype | None = None) -> Iterator[tuple[str, object]]:
    """(file, its tensors) for each weight file: a safetensors handle, or a GGUF file's GGUFWeights —
    or, given the model's `dtype`, that file's weights saved dequantized in it (models/gguf_cache.py)."""
    gguf = gguf_file(model_path)
    if gguf is not None:
        saved = gguf_cache.saved_weights(gguf, dtype) if dtype is not None else None
        if saved is not None:
            with safe_open(saved, framework="pt") as f:
                yield saved, f
            return
        yield gguf, GGUFWeights(gguf, cfg)
        return
    for path in _checkpoint_files(model_path):
        with safe_open(path, framework="pt") as f:
            yield path, f


def _param_name(key: str, cfg: dict) -> str:
    """The model's name for checkpoint tensor `key` (GPT-2 checkpoints may omit "transformer.")."""
    if key.endswith(".weight_scale_inv"):  # a block-wise fp8 checkpoint's name for the scales
        key = key.removesuffix("_inv")
    is_gpt2 = "GPT2LMHeadModel" in cfg.get("architectures", [])
    return "transformer." + key if is_gpt2 and not key.startswith(("transformer.", "lm_head.")) else key


def _fp8_layers(model_path: str, cfg: dict) -> list[str]:
    """The layers an FP8 checkpoint stores in FP8: those with a `weight_scale` (`weight_scale_inv`)
    (not its `ignore` list: the tensors are what loads)."""
    names = [
        _param_name(key, cfg).removesuffix(".weight_scale")
        for _, f in checkpoint_sources(model_path, cfg)
        for key in f.keys()
        if key.endswith((".weight_scale", ".weight_scale_inv"))
    ]
    if not names:
        raise ValueError(f"{model_path}: config.json declares FP8 weights, but no tensor has a weight_scale")
    return names


def _load_weights(model: torch.nn.Module, model_path: str, cfg: dict, dtype: torch.dtype, save_gguf: bool) -> None:
    """`save_gguf`: a GGUF file read whole (not a TP rank's shard) is saved dequantized for the next start."""
    params = dict(model.named_parameters())  # tied weights appear once, under the first name
    device = next(iter(params.values())).device
    staging = PinnedStaging(device) if device.type == "cuda" else None
    try:
        _copy_weights(params, model, model_path, cfg, staging, dtype, save_gguf)
    finally:
        if staging is not None:
            staging.finish()


def _copy_weights(
    params: dict, model: torch.nn.Module, model_path: str, cfg: dict, staging, dtype: torch.dtype, save_gguf: bool
) -> None:
    is_gpt2 = "GPT2LMHeadModel" in cfg.get("architectures", [])
    loaded: set[str] = set()
    writer = None
    for path, f in checkpoint_sources(model_path, cfg, dtype):
        if isinstance(f, GGUFWeights) and save_gguf:
            writer = gguf_cache.WeightsWriter(path, dtype)
        for key in f.keys():
            if key.endswith(_IGNORED_SUFFIXES):
                continue
            name = _param_name(key, cfg)
            if name not in params:
                if name == "lm_head.weight" and "lm_head.weight" not in params:
                    continue  # tied: the embedding already holds it
                if key.endswith(".input_scale"):
                    raise ValueError(f"{key!r} in {path}: static activation scales (input_scale) are not supported")
                raise ValueError(f"unexpected weight {key!r} in {path}")
            transposed = is_gpt2 and name.endswith(TRANSPOSED)
            shard = _shard_of(model, name)
            if name.endswith(".weight_scale") and math.prod(f.get_slice(key).get_shape()) == 1:
                shard = None  # a per-tensor scale: every rank's rows share it
            tensor = _read(f, key, shard, transposed, params[name])
            if writer is not None:  # (the checkpoint's own layout: GPT-2's Conv1D back to [in, out])
                writer.add(key, tensor.t() if transposed else tensor, params[name].dtype)
            if name.endswith(".weight_scale") and params[name].dim() == 2:  # block scales, as stored
                tensor = tensor.float()
            elif name.endswith(".weight_scale"):
                tensor = fp8.channel_scales(tensor, rows=params[name].shape[0])
            if (tensor.dtype == fp8.FP8) != (params[name].dtype == fp8.FP8):
                # NOTE: copy_ would convert silently, dropping (or never applying) the scale.
                raise ValueError(
                    f"weight {key!r} is {tensor.dtype}, the model's is {params[name].dtype}: FP8 weights need "
                    "their weight_scale beside them, and nothing else may be FP8"
                )
            if tensor.shape != params[name].shape:
                raise ValueError(f"weight {key!r}: shape {tuple(tensor.shape)} != {tuple(params[name].shape)}")
            with torch.no_grad():
                if staging is not None:
                    staging.copy(params[name], tensor)
                else:
                    params[name].copy_(tensor)
            loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"checkpoint {model_path} lacks weights: {missing[:5]}{'...' if len(missing) > 5 else ''}")
    if writer is not None:
        writer.finish()


def _shard_of(model: torch.nn.Module, name: str) -> Shard | None:
    owner, _, leaf = name.rpartition(".")
    return getattr(model.get_submodule(owner), "tp_shards", {}).get(leaf)


def _read(f, key: str, shard: Shard | None, transposed: bool, param: torch.Tensor) -> torch.Tensor:
    """This rank's part of checkpoint tensor `key`, in the parameter's layout; only the shard's
    slices are read. `transposed`: stored as [in, out] (GPT-2's Conv1D). `f`: a safetensors handle
    or GGUFWeights (keys, get_slice(key)[index], get_slice(key).get_shape(), get_tensor)."""
    if shard is not None and shard.zeros:
        return torch.zeros(param.shape, dtype=param.dtype)
    sliced = f.get_slice(key)
    shape = sliced.get_shape()
    dim = 1 - shard.dim if shard is not None and transposed else shard.dim if shard is not None else 0
    if shard is None or shard.ranges == ((0, shape[dim]),):
        tensor = f.get_tensor(key)  # the whole tensor (tp = 1, or a replicated one)
    else:
        pieces = []
        for start, stop in shard.ranges:
            end = min(stop, shape[dim])
            index = [slice(None)] * len(shape)
            index[dim] = slice(start, end)
            piece = sliced[tuple(index)]
            if stop > end:  # past the last row: padding (a vocab that tp does not divide)
                pad = list(piece.shape)
                pad[dim] = stop - end
                piece = torch.cat([piece, piece.new_zeros(pad)], dim=dim)
            pieces.append(piece)
        tensor = torch.cat(pieces, dim=dim)
    return tensor.t() if transposed else tensor
