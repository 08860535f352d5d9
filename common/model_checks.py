"""Start-up checks of a checkpoint against the engine's flags: does it split into --tp-size ranks,
and is its quantization one the engine serves. Torch-free: EngineConfig.resolve runs them before
anything loads, so a bad combination stops the start with a ValueError naming the field.

FP8 checkpoints are recognised by config.json's `quantization_config` in the two forms users
download (engine/models/fp8.py holds the numerics, docs/architecture.md "FP8 weights"):

    compressed-tensors   llm-compressor's format (the "-FP8-dynamic" models): config_groups whose
                         weights are {num_bits: 8, type: float, strategy: channel | tensor} and whose
                         input activations are dynamic or absent; `<layer>.weight` float8_e4m3fn,
                         `<layer>.weight_scale` [N, 1] (channel) or [1] (tensor). Or (FP8_BLOCK)
                         weights {strategy: block, block_structure: [bn, bk]}, input activations
                         dynamic groups of bk or absent; `<layer>.weight_scale` [ceil(N / bn), ceil(K / bk)]
    fp8                  AutoFP8 / vLLM's per-tensor form: activation_scheme dynamic, no
                         weight_block_size; `<layer>.weight_scale` a scalar. With weight_block_size
                         [bn, bk] (DeepSeek-V3, Qwen3-*-FP8): `<layer>.weight_scale_inv`
                         [ceil(N / bn), ceil(K / bk)], activations scaled per token and group of bk

Block-wise checkpoints resolve to "fp8-block" (engine/models/fp8_block.py), the others to "fp8".

Which layers are FP8 is what the tensors say (a `weight_scale` beside the weight), not the
`ignore` list: the loader reads it from the checkpoint.
"""

from __future__ import annotations

from pathlib import Path

from pdserve.common import gguf_checkpoint
from pdserve.common.gpus import cuda_device_count

QUANTIZATIONS = ("", "fp8", "fp8-block")
# block_k of a block-wise FP8 weight: the GEMM's K step is one scale group (engine/models/fp8_block.py).
BLOCK_K_SIZES = (32, 64, 128, 256)
# compressed-tensors formats whose weights are stored as float8 values with their scales.
_FLOAT_FORMATS = ("float-quantized", "naive-quantized")


def check_model_path(model_path: str) -> None:
    """ValueError unless `model_path` is a checkpoint: a directory with config.json, or GGUF."""
    if (Path(model_path) / "config.json").is_file() or gguf_checkpoint.gguf_file(model_path) is not None:
        return
    raise ValueError(
        f"--model-path {model_path!r} has no config.json and is not a .gguf file (or a directory holding one)"
    )


def check_tp(tp: int, dist_timeout: float, hf: dict, device: str) -> None:
    """ValueError unless the model splits into `tp` ranks (heads, KV heads, MLP width) and, on CUDA,
    there is a GPU for every rank. A vocab that tp does not divide is padded, so any vocab works."""
    if tp < 1:
        raise ValueError(f"--tp-size must be >= 1, got {tp}")
    if not dist_timeout > 0:
        raise ValueError(f"--dist-timeout must be > 0, got {dist_timeout}")
    if tp == 1:
        return
    heads = hf.get("num_attention_heads") or hf.get("n_head")
    kv_heads = model_kv_heads_of(hf)
    width = hf.get("intermediate_size") or hf.get("n_inner") or 4 * hf.get("n_embd", 0)
    if heads % tp:
        raise ValueError(f"--tp-size {tp} does not divide the model's {heads} attention heads")
    if kv_heads % tp if kv_heads >= tp else tp % kv_heads:
        raise ValueError(
            f"--tp-size {tp} must divide the model's {kv_heads} KV heads, or be a multiple of them (replicated)"
        )
    if width % tp:
        raise ValueError(f"--tp-size {tp} does not divide the model's MLP width {width}")
    if device.startswith("cuda"):
        first = int(device.partition(":")[2] or 0)
        visible = cuda_device_count()
        if first + tp > visible:
            raise ValueError(f"--tp-size {tp} needs GPUs {first}..{first + tp - 1} (one per rank); {visible} visible")


def model_kv_heads_of(hf: dict) -> int:
    """The checkpoint's KV heads (its attention heads when it has no grouped-query attention)."""
    return hf.get("num_key_value_heads") or hf.get("num_attention_heads") or hf.get("n_head")


def resolve_quantization(quantization: str, hf: dict, model_path: str, tp: int) -> str:
    """What the weights are served as: the checkpoint's FP8 form ("fp8", or "fp8-block" for block
    scales) when it is FP8, whatever --quantization says; else --quantization ("fp8": per-channel
    scales, "fp8-block": 128 x 128 blocks; "": the checkpoint's dtype). ValueError for an unknown
    choice, a checkpoint format the engine does not read, and block-wise FP8 with tensor parallelism
    (Fp8BlockLinear has no sharded form yet; per-channel Fp8Linear does). A GGUF checkpoint's weights
    are dequantized at load like any float checkpoint's, so --quantization then quantizes those."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(
            f"--quantization must be fp8, fp8-block or empty (the checkpoint's own dtype), got {quantization!r}"
        )
    resolved = checkpoint_quantization(hf) or quantization
    if resolved == "fp8-block" and tp > 1:
        raise ValueError(
            "block-wise FP8 weights (--quantization fp8-block, or a block-wise checkpoint) need --tp-size 1"
        )
    return resolved


def checkpoint_quantization(hf: dict) -> str:
    """ "fp8" (per-tensor or per-channel scales) or "fp8-block" when config.json's quantization_config
    describes FP8 weights the engine reads, "" when there is none; ValueError, naming the field, for
    any other quantization."""
    qc = hf.get("quantization_config")
    if not qc:
        return ""
    method = qc.get("quant_method")
    if method == "compressed-tensors":
        _check_compressed_tensors(qc)
    elif method == "fp8":
        _check_fp8(qc)
    else:
        raise ValueError(
            f"quantization_config.quant_method {method!r} is not supported: pdserve reads FP8 checkpoints "
            "(compressed-tensors or fp8) and unquantized ones"
        )
    return "fp8-block" if checkpoint_weight_block(hf) else "fp8"


def checkpoint_weight_block(hf: dict) -> tuple[int, int] | None:
    """[block_n, block_k] of a block-wise FP8 checkpoint's weight scales (checked by
    checkpoint_quantization), None for any other checkpoint."""
    qc = hf.get("quantization_config") or {}
    if qc.get("quant_method") == "fp8":
        block = qc.get("weight_block_size")
    elif qc.get("quant_method") == "compressed-tensors":
        block = next(iter((qc.get("config_groups") or {}).values()), {}).get("weights", {}).get("block_structure")
    else:
        block = None
    return tuple(block) if block else None


def check_weight_block(block, where: str) -> None:
    """ValueError unless `block` is a [block_n, block_k] the block-wise FP8 layers serve."""
    if (
        not isinstance(block, (list, tuple))
        or len(block) != 2
        or not all(isinstance(b, int) and b >= 1 for b in block)
        or block[1] not in BLOCK_K_SIZES
    ):
        raise ValueError(
            f"{where} {block!r}: block-wise FP8 weights need [block_n, block_k] with block_k one of "
            f"{list(BLOCK_K_SIZES)} and block_n >= 1 (checkpoints use [128, 128])"
        )


def _check_compressed_tensors(qc: dict) -> None:
    where = "quantization_config"
    fmt = qc.get("format")
    if fmt is not None and fmt not in _FLOAT_FORMATS:
        raise ValueError(f"{where}.format {fmt!r} is not supported (FP8: {' or '.join(_FLOAT_FORMATS)})")
    # llm-compressor's static per-tensor FP8 KV scales are read with --kv-cache-dtype fp8_e4m3.
    kv = qc.get("kv_cache_scheme") or {}
    form = (kv.get("num_bits"), kv.get("type"), kv.get("strategy", "tensor"), kv.get("dynamic", False))
    if kv and form != (8, "float", "tensor", False):
        raise ValueError(f"{where}.kv_cache_scheme {kv}: only static per-tensor FP8 KV scales are supported")
    groups = qc.get("config_groups") or {}
    if not groups:
        raise ValueError(f"{where}.config_groups is empty: no FP8 weights described")
    forms = set()
    for name, group in groups.items():
        forms.add(_check_group(f"{where}.config_groups.{name}", group))
    if len(forms) > 1:
        raise ValueError(f"{where}.config_groups mix weight forms {sorted(map(str, forms))}: one form per checkpoint")


def _check_group(at: str, group: dict):
    """A compressed-tensors config group's weight form: "channel or tensor", or its block_structure."""
    weights = group.get("weights") or {}
    if (weights.get("num_bits"), weights.get("type")) != (8, "float"):
        raise ValueError(
            f"{at}.weights: num_bits {weights.get('num_bits')!r}, type {weights.get('type')!r} is not "
            "supported (FP8: num_bits 8, type float)"
        )
    strategy = weights.get("strategy")
    if strategy not in ("channel", "tensor", "block"):
        raise ValueError(
            f"{at}.weights.strategy {strategy!r} is not supported (channel, tensor or block; group-wise FP8 is not)"
        )
    if weights.get("dynamic") or weights.get("symmetric") is False:
        raise ValueError(f"{at}.weights must be static and symmetric (stored scales, no zero point)")
    inputs = group.get("input_activations")
    if inputs is not None and not inputs.get("dynamic"):
        raise ValueError(
            f"{at}.input_activations.dynamic is false: static activation scales (input_scale) are not "
            "supported; pdserve scales activations dynamically"
        )
    if inputs is not None and (inputs.get("num_bits"), inputs.get("type")) != (8, "float"):
        raise ValueError(f"{at}.input_activations must be FP8 (num_bits 8, type float)")
    if group.get("output_activations"):
        raise ValueError(f"{at}.output_activations: quantized outputs are not supported")
    if strategy != "block":
        return "channel or tensor"
    block = weights.get("block_structure")
    check_weight_block(block, f"{at}.weights.block_structure")
    # The block GEMM scales activations per token and group of block_k, as llm-compressor's FP8_BLOCK
    # calibrates them; no input_activations (weight-only) is served the same way.
    form = (inputs.get("strategy"), inputs.get("group_size")) if inputs is not None else ("group", block[1])
    if form != ("group", block[1]):
        raise ValueError(
            f"{at}.input_activations: strategy {form[0]!r}, group_size {form[1]!r} with block weights is not "
            f"supported (dynamic groups of {block[1]}, the block's K side)"
        )
    return tuple(block)


def _check_fp8(qc: dict) -> None:
    if qc.get("weight_block_size") is not None:
        check_weight_block(qc["weight_block_size"], "quantization_config.weight_block_size")
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ValueError(
            f"quantization_config.activation_scheme {scheme!r}: static activation scales (input_scale) are "
            "not supported; pdserve scales activations dynamically per token"
        )
    if qc.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"quantization_config.fmt {qc['fmt']!r} is not supported (e4m3)")


# Checkpoint tensors holding a layer's KV cache scales: compressed-tensors' self_attn.k_scale and
# v_scale, and the k_proj/v_proj output_scale vLLM also reads.
KV_SCALE_SUFFIXES = (".k_scale", ".v_scale", ".k_proj.output_scale", ".v_proj.output_scale")


def resolve_kv_cache_dtype(flag: str, dtype: str) -> str:
    """--kv-cache-dtype resolved: the model's dtype name (auto), or fp8_e4m3."""
    if flag in ("auto", dtype):
        return dtype
    if flag != "fp8_e4m3":
        raise ValueError(f"--kv-cache-dtype must be auto or fp8_e4m3, got {flag!r}")
    return flag
