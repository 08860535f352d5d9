"""Block-wise FP8 checkpoints as users download them, written from a tiny model; optionally served.

    python -m pdserve.bench.micro.fp8_checkpoints --out DIR [--arch llama] [--serve]

Both spellings (the formats' fields and tensor names as the real checkpoints use them):
    fp8 block          quant_method fp8, weight_block_size [128, 128], activation_scheme dynamic, fmt
                       e4m3; `<layer>.weight_scale_inv` [ceil(N/128), ceil(K/128)] (DeepSeek-V3, Qwen3-*-FP8)
    compressed block   compressed-tensors, weights {strategy: block, block_structure: [128, 128]}, input
                       activations dynamic groups of 128; `<layer>.weight_scale` (llm-compressor's FP8_BLOCK)

The tiny model is widened (hidden 256, MLP 320, q 256 rows, k/v 64) so that every projection has
several 128 x 128 tiles, partial ones included. With --serve, each checkpoint is served by a fresh
`pdserve up` (its defaults: the GPU where there is one) and asked by the official openai client for a
greedy completion; printed beside it, the offline engine's greedy tokens for the same prompt ids on the
same device (equal: the served path adds nothing). tests/test_fp8_block_checkpoints.py checks what
these checkpoints compute against their dequantized twins.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import socket
import subprocess
import sys
import time

FP8_BLOCK_CONFIG = {
    "quant_method": "fp8",
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "weight_block_size": [128, 128],
}
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
WIDE = {"hidden_size": 256, "intermediate_size": 320, "num_attention_heads": 8, "head_dim": 32}


def compressed_tensors_config(weights: dict, input_activations: dict) -> dict:
    """compressed-tensors' FP8 quantization_config as config.json spells it: one group over every
    Linear (the LM head ignored), with these weight and input-activation schemes."""
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": input_activations,
                "output_activations": None,
            }
        },  # fmt: skip
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
    }


def compressed_block_config(block=(128, 128), inputs=None) -> dict:
    """llm-compressor's FP8_BLOCK preset as its config.json spells it."""
    fp8_of = {"num_bits": 8, "type": "float", "symmetric": True, "actorder": None, "observer_kwargs": {}}
    weights = {**fp8_of, "strategy": "block", "block_structure": list(block), "group_size": None, "dynamic": False,
               "observer": "minmax"}  # fmt: skip
    activations = {**fp8_of, "strategy": "group", "group_size": block[1], "block_structure": None, "dynamic": True,
                   "observer": None, **(inputs or {})}  # fmt: skip
    return compressed_tensors_config(weights, activations)


# form -> (the scale tensors' suffix, config.json's quantization_config; None: compressed_block_config())
FORMATS = {"fp8 block": ("weight_scale_inv", FP8_BLOCK_CONFIG), "compressed block": ("weight_scale", None)}


def is_block_linear(key: str) -> bool:
    return key.endswith(".weight") and key.split(".")[-2] in LINEARS


def quantize_tiles(weight, tile: int = 128):
    """(float8 weight, scales [ceil(N/tile), ceil(K/tile)], the dequantized fp32 weight), tile by tile
    with plain torch casts (written apart from the engine's vectorized fp8_block.quantize_blockwise)."""
    import torch

    fp8 = torch.float8_e4m3fn
    n, k = weight.shape
    rows, cols = -(-n // tile), -(-k // tile)
    q, scales, back = torch.empty(n, k, dtype=fp8), torch.empty(rows, cols), torch.empty(n, k)
    for i in range(rows):
        for j in range(cols):
            at = (slice(i * tile, (i + 1) * tile), slice(j * tile, (j + 1) * tile))
            scales[i, j] = weight[at].abs().amax() / 448
            q[at] = (weight[at] / scales[i, j]).to(fp8)
            back[at] = q[at].float() * scales[i, j]
    return q, scales, back


def write_block_checkpoints(src, dst, form: str) -> tuple[str, str, dict]:
    """(block-wise FP8 checkpoint of `src` as `form` stores it, its dequantized fp32 twin, the scales by layer)."""
    from safetensors.torch import load_file, save_file

    scale_name, quantization_config = FORMATS[form]
    quantized, dequantized = dst / "fp8", dst / "dequantized"
    shutil.copytree(src, quantized)
    shutil.copytree(src, dequantized)
    weights = load_file(f"{src}/model.safetensors")
    fp8_weights, float_weights, scales = dict(weights), dict(weights), {}
    for key in [k for k in weights if is_block_linear(k)]:
        q, scale, back = quantize_tiles(weights[key])
        layer = key.removesuffix(".weight")
        fp8_weights[key], fp8_weights[f"{layer}.{scale_name}"], float_weights[key] = q, scale, back
        scales[layer] = scale
    save_file(fp8_weights, f"{quantized}/model.safetensors", metadata={"format": "pt"})
    save_file(float_weights, f"{dequantized}/model.safetensors", metadata={"format": "pt"})
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = quantization_config or compressed_block_config()
    (quantized / "config.json").write_text(json.dumps(config))
    return str(quantized), str(dequantized), scales


def offline_tokens(path: str, prompt: list[int], max_tokens: int) -> list[int]:
    """The offline engine's greedy tokens (the device `pdserve up` would pick)."""
    import torch

    from pdserve.common.engine.engine import Engine
    from pdserve.common.types import SamplingParams

    # A small pool: the next form's `pdserve up` sizes its own from the GPU's free memory.
    engine = Engine(model_path=path, device="cuda" if torch.cuda.is_available() else "cpu", max_total_tokens=4096)
    try:
        params = SamplingParams(max_new_tokens=max_tokens, temperature=0, ignore_eos=True)
        return list(engine.generate([prompt], params)[0].output_ids)
    finally:
        engine.close()
        del engine
        gc.collect()
        torch.cuda.empty_cache()


def served_tokens(path: str, prompt: list[int], max_tokens: int, log_path: str) -> tuple[list[int], float]:
    """(the greedy tokens a fresh `pdserve up` answers the official client with, seconds to be up)."""
    from openai import OpenAI

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    began = time.monotonic()
    with open(log_path, "w") as log:
        up = subprocess.Popen(
            [sys.executable, "-m", "pdserve.common.cli", "up", "--model-path", path, "--port", str(port)],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        while "pdserve is up" not in open(log_path).read():
            if up.poll() is not None or time.monotonic() - began > 300:
                raise RuntimeError(f"pdserve up did not start: see {log_path}")
            time.sleep(0.5)
        ready_s = time.monotonic() - began
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        answer = client.completions.create(
            model=client.models.list().data[0].id,
            prompt=prompt, max_tokens=max_tokens, temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )  # fmt: skip
        return list(answer.choices[0].model_extra["token_ids"]), ready_s
    finally:
        up.send_signal(2)
        up.wait(60)


def main() -> None:
    import pathlib

    from pdserve.common.tiny_model import make_tiny_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="A new folder for the checkpoints.")
    parser.add_argument("--arch", default="llama", help="A tiny model's architecture (common/tiny_model.py ARCHS).")
    parser.add_argument("--serve", action="store_true", help="Serve each through `pdserve up` and ask it.")
    parser.add_argument("--max-tokens", type=int, default=24)
    args = parser.parse_args()
    out = pathlib.Path(args.out)
    src = make_tiny_model(out / f"{args.arch}-float", args.arch, seed=0, overrides=WIDE)
    prompt = [1] + [(7 * i) % 500 + 5 for i in range(40)]
    for form in FORMATS:
        dst = out / form.replace(" ", "-")
        dst.mkdir(parents=True, exist_ok=True)
        path = write_block_checkpoints(src, dst, form)[0]
        print(f"{form}: {path}", flush=True)
        if not args.serve:
            continue
        got, ready_s = served_tokens(path, prompt, args.max_tokens, str(dst / "up.log"))
        want = offline_tokens(path, prompt, args.max_tokens)
        same = "equal" if got == want else "DIFFERENT"
        print(f"  served (up after {ready_s:.1f} s): {got}\n  offline: {want}\n  {same}", flush=True)


if __name__ == "__main__":
    main()
