"""A GGUF file's weights as the model loads them, dequantized once per host and kept in the cache.

    saved = saved_weights(gguf_path, dtype)      # a safetensors file of them, or None
    writer = WeightsWriter(gguf_path, dtype)     # the loader hands it each whole tensor it read:
    writer.add(key, tensor, param_dtype)         # ... and once every weight is loaded:
    writer.finish()

Why: gguf's dequantize (numpy) is most of a GGUF server's start-up on a CPU: SmolLM2-135M's Q4_1,
1.5-1.6 s (1.9-2.0 s of CPU) in each server's weights phase, the two servers of a `pdserve up` side by
side on a 2-core box whose start is bound by its CPU. Saved as safetensors in the model's dtype (what
the loader would make of them: the same values, rounded once, as it would round them), a later start
maps them in 0.01-0.1 s, and the loader reads them as any safetensors checkpoint (slices for TP ranks).

Keyed like the GGUF metadata (common/gguf_checkpoint.py): the file's path, size and modification time,
gguf's version, this format's version, and the dtype. Written whole or not at all (a temporary file
renamed into place: two servers starting together may both write; the last rename wins, the same
bytes). Bounded: entries whose size would pass PDSERVE_GGUF_CACHE_GB (default 4) are not written, and
the oldest entries go when the folder passes it (a read renews an entry); 0 keeps none. A saved
entry that cannot be read is dropped and the file dequantized again.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pathlib
import tempfile

import torch

from pdserve.common.cache import cache_root

log = logging.getLogger(__name__)

FORMAT = 1  # bump when what a saved entry holds changes
LIMIT_ENV = "PDSERVE_GGUF_CACHE_GB"
DEFAULT_LIMIT_GB = 4.0


def limit_bytes() -> int:
    value = os.environ.get(LIMIT_ENV, "")
    try:
        gb = float(value) if value else DEFAULT_LIMIT_GB
    except ValueError:
        log.warning("%s=%r is not a number: using %s", LIMIT_ENV, value, DEFAULT_LIMIT_GB)
        gb = DEFAULT_LIMIT_GB
    return int(max(gb, 0.0) * 2**30)


def folder() -> pathlib.Path:
    return cache_root() / "gguf-weights"


def entry_path(gguf_path: str, dtype: torch.dtype) -> pathlib.Path:
    from importlib.metadata import version

    st = os.stat(gguf_path)
    key = f"{os.path.abspath(gguf_path)}|{st.st_size}|{st.st_mtime_ns}|gguf {version('gguf')}|weights {FORMAT}|{dtype}"
    return folder() / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.safetensors"


def saved_weights(gguf_path: str, dtype: torch.dtype) -> str | None:
    """The saved weights of `gguf_path` in `dtype`, checked to open, or None (none saved, or unreadable:
    then dropped)."""
    if limit_bytes() == 0:
        return None
    path = entry_path(gguf_path, dtype)
    if not path.exists():
        return None
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            f.keys()
        os.utime(path)  # (recently used: the last to go)
    except Exception as e:  # noqa: BLE001 - any damage: the file is dequantized again
        log.warning("dropping the saved GGUF weights %s (%s): dequantizing %s again", path, e, gguf_path)
        path.unlink(missing_ok=True)
        return None
    return str(path)


class WeightsWriter:
    """Collects the tensors a load read whole from a GGUF file and saves them once the load is done."""

    def __init__(self, gguf_path: str, dtype: torch.dtype):
        self.gguf_path, self.dtype = gguf_path, dtype
        self.limit = limit_bytes()
        self.tensors: dict[str, torch.Tensor] = {}
        self.bytes = 0
        self.wanted = self.limit > 0

    def add(self, key: str, tensor: torch.Tensor, dtype: torch.dtype) -> None:
        """`tensor`: the checkpoint's whole tensor `key` as read (on the host), kept as `dtype` (its
        parameter's, which it is copied into)."""
        if not self.wanted:
            return
        self.bytes += tensor.numel() * dtype.itemsize
        if self.bytes > self.limit:
            log.info(
                "not saving %s's dequantized weights: over %.1f GB (%s)", self.gguf_path, self.limit / 2**30, LIMIT_ENV
            )
            self.wanted, self.tensors = False, {}
            return
        self.tensors[key] = tensor.to(dtype=dtype, copy=True).contiguous()

    def finish(self) -> None:
        """Save what was collected (best effort: a load never fails for it)."""
        if not self.wanted or not self.tensors:
            return
        from safetensors.torch import save_file

        path = entry_path(self.gguf_path, self.dtype)
        tmp = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".writing-")
            os.close(fd)
            save_file(self.tensors, tmp)
            os.replace(tmp, path)  # atomic: a reader sees no entry or this one whole
            tmp = None
            log.info("saved %s's weights dequantized to %s (%.2f GB)", self.gguf_path, path, self.bytes / 1e9)
        except OSError as e:
            log.warning("not saving %s's dequantized weights: %s", self.gguf_path, e)
        finally:
            self.tensors = {}
            if tmp is not None:
                pathlib.Path(tmp).unlink(missing_ok=True)
        evict(self.limit)


def evict(limit: int) -> None:
    """Remove the least recently used entries until the folder holds at most `limit` bytes."""
    try:
        entries = [(p.stat().st_mtime, p.stat().st_size, p) for p in folder().glob("*.safetensors")]
    except OSError:
        return
    total = sum(size for _, size, _ in entries)
    for _, size, path in sorted(entries, key=lambda e: e[0]):
        if total <= limit:
            break
        try:
            path.unlink()
            total -= size
        except OSError:
            pass
