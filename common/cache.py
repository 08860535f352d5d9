"""pdserve's cache on this host: $PDSERVE_CACHE, else ~/.cache/pdserve (the one place it is read).

random-weights/   the benchmarks' random-weight checkpoints (bench/random_weights.py)
tokenizers/       GGUF tokenizers converted once (common/gguf_tokenizer.py)
transformers-index/  transformers' index of its models, built once per installed copy (common/transformers_index.py)
gguf-info/        GGUF files' metadata, parsed once (common/gguf_checkpoint.py)
gguf-weights/     GGUF files' weights, dequantized once, bounded (common/engine/models/gguf_cache.py)
"""

from __future__ import annotations

import os
import pathlib


def cache_root() -> pathlib.Path:
    return pathlib.Path(os.environ.get("PDSERVE_CACHE") or pathlib.Path.home() / ".cache" / "pdserve")
