"""Random-weight checkpoints for benchmarks, built once into a cache and reused.

    path = random_weight_checkpoint("gpt2/small")   # $PDSERVE_CACHE/random-weights/gpt2-small
    add_model_args(parser); path = model_path_from_args(args)   # --model-path | --random-weights

`ARCH/tiny` is exactly make_tiny_model(dir, arch, seed=0). Full-size shapes use the same config,
tokenizer and weight scales (make_tiny_model's functions) but store bfloat16 weights, drawn one
tensor at a time. On a 2-core box, for llama/1b: make_tiny_model (every tensor drawn and kept in
float32) took 25-80 s, 5.4 GB of RAM and wrote 4.7 GB; this takes 15 s, 3 GB and writes 2.5 GB.

The tiny tokenizer has 512 tokens; full-size shapes get it widened to the model's vocab_size with
synthetic word tokens (" t0", " t1", ...). NOTE: without that, most ids a 50257-row model samples
would decode to nothing: the router streams a chunk only when the text grows (so the serving
benchmark would see no inter-token gaps) and rejects prompt ids beyond the tokenizer.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import tempfile
import time

from pdserve.bench.shapes import resolve_shape, shape_names
from pdserve.common.cache import cache_root

SEED = 0
RECIPE_FILE = "pdserve-random-weights.json"
RECIPE_VERSION = 1


def add_model_args(parser: argparse.ArgumentParser, model_path_flag: bool = True) -> None:
    """--random-weights ARCH/SHAPE, and --model-path DIR unless the parser has it already (engine flags)."""
    if model_path_flag:
        parser.add_argument("--model-path", default="", help="Checkpoint directory.")
    parser.add_argument(
        "--random-weights",
        default=None,
        metavar="ARCH/SHAPE",
        help=f"A random-weight checkpoint of this shape, built once into $PDSERVE_CACHE or "
        f"~/.cache/pdserve (instead of --model-path): {', '.join(shape_names())}.",
    )


def model_path_from_args(args: argparse.Namespace, required: bool = True) -> str:
    """--model-path, or the --random-weights checkpoint (built on first use; args.model_path is set
    to it). '' when neither is given and not required."""
    if args.random_weights and args.model_path:
        raise ValueError("give --model-path or --random-weights, not both")
    if args.random_weights:
        args.model_path = str(random_weight_checkpoint(args.random_weights))
    if required and not args.model_path:
        raise ValueError("give --model-path DIR or --random-weights ARCH/SHAPE")
    return args.model_path


def random_weight_checkpoint(shape: str, root: str | os.PathLike | None = None) -> pathlib.Path:
    """The checkpoint directory of `ARCH/SHAPE`, built on first use and reused while its recipe matches."""
    arch, overrides = resolve_shape(shape)
    recipe = {"shape": shape, "arch": arch, "overrides": overrides, "seed": SEED, "version": RECIPE_VERSION}
    parent = pathlib.Path(root) if root is not None else cache_root() / "random-weights"
    target = parent / shape.replace("/", "-")
    if _recipe_of(target) == recipe:
        return target
    parent.mkdir(parents=True, exist_ok=True)
    print(f"building the random-weight checkpoint {shape} in {target} (once; reused afterwards)", flush=True)
    start = time.perf_counter()
    # Built aside and renamed into place, so an interrupted build is never mistaken for a finished one.
    staging = pathlib.Path(tempfile.mkdtemp(dir=parent, prefix=target.name + ".building-"))
    try:
        write_checkpoint(staging, arch, overrides)
        (staging / RECIPE_FILE).write_text(json.dumps(recipe, indent=2, sort_keys=True) + "\n")
        if target.exists():  # a stale recipe
            shutil.rmtree(target)
        try:
            staging.rename(target)
        except OSError:
            if _recipe_of(target) != recipe:  # not a concurrent build of the same thing
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    print(f"built {shape} in {time.perf_counter() - start:.1f} s", flush=True)
    return target


def _recipe_of(path: pathlib.Path) -> dict | None:
    try:
        return json.loads((path / RECIPE_FILE).read_text())
    except (OSError, ValueError):
        return None


def write_checkpoint(out: pathlib.Path, arch: str, overrides: dict) -> None:
    from pdserve.common.tiny_model import make_tiny_model

    if not overrides:
        make_tiny_model(out, arch, SEED)
        return
    import torch
    from safetensors.torch import save_file

    from pdserve.common import tiny_model

    config = tiny_model.gpt2_config() if arch == "gpt2" else tiny_model.llama_like_config(arch)
    config.update(overrides)
    config["dtype"] = "bfloat16"
    shapes = tiny_model.gpt2_shapes(config) if arch == "gpt2" else tiny_model.llama_like_shapes(arch, config)
    weights = {}
    for index, name in enumerate(sorted(shapes)):
        # make_tiny_model's scales for this tensor, drawn in float32 and kept in bfloat16.
        [(_, tensor)] = tiny_model.random_weights({name: shapes[name]}, SEED + index).items()
        weights[name] = tensor.to(torch.bfloat16)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", tiny_model.generation_config())
    tiny_model.write_tokenizer(out)
    widen_tokenizer(out, config["vocab_size"])


def widen_tokenizer(out: pathlib.Path, vocab_size: int) -> None:
    """Append synthetic tokens to tokenizer.json's BPE vocab until it has vocab_size entries.

    They are plain vocab entries (no merges produce them, so encoding text never yields them);
    each decodes to " t<N>" through the byte-level decoder.
    """
    path = out / "tokenizer.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    vocab = data["model"]["vocab"]
    n = 0
    while len(vocab) < vocab_size:
        piece = f"\u0120t{n}"  # \u0120 is the byte-level alphabet's space
        n += 1
        if piece not in vocab:
            vocab[piece] = len(vocab)
    path.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")


def _write_json(path: pathlib.Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")
