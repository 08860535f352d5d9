"""A GGUF file's tokenizer (chat template included), converted by transformers once per host.

    load_tokenizer(path)     the tokenizer of GGUF file `path`, read from the cache when converted before
    convert_once(path)       converted into the cache (by a child process) unless it is there already

transformers builds it from the file's metadata: seconds (4.7 s for SmolLM2 on the CI box, in each of
a deployment's processes), where loading its saved form takes 0.2 s. The saved form lives in the cache
(common/cache.py: tokenizers/), keyed by the file's path, size and modification time and by the
transformers version that converted it; it is written to a temporary folder and renamed into place,
so processes converting at once never see half of one.

The conversion needs torch (transformers' GGUF reader asks for it). A process kept torch-free
(common/torch_free.py: the router's) has it done by a child process, `python -m
pdserve.common.gguf_tokenizer GGUF DEST`, and loads what that wrote: once per host, as any other
process's conversion.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

from pdserve.common.cache import cache_root

log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=8)
def load_tokenizer(path: str):
    """The tokenizer of GGUF file `path`, from the cache, else converted (here, or in a child process
    where torch is kept out) and saved there.

    NOTE: shared by every caller in the process; nobody may mutate it."""
    from transformers import AutoTokenizer
    from transformers.utils import is_torch_available

    saved = converted_tokenizer_dir(path)
    if saved.is_dir():
        try:
            return AutoTokenizer.from_pretrained(str(saved), local_files_only=True)
        except (OSError, ValueError) as e:  # a damaged cache entry: convert again
            log.warning("cannot load the converted tokenizer in %s (%s): converting again", saved, e)
    if not is_torch_available():
        return _converted_elsewhere(path, saved)
    tokenizer = _convert(path)
    save_converted(tokenizer, saved)
    return tokenizer


def _convert(path: str):
    from transformers import AutoTokenizer

    folder, name = os.path.split(os.path.abspath(path))
    return AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)


def _converted_elsewhere(path: str, saved: pathlib.Path):
    """Converted by a child process (which may import torch) into the cache, or, where the cache
    cannot be written, into a temporary folder removed once loaded."""
    from transformers import AutoTokenizer

    scratch = None
    try:
        saved.parent.mkdir(parents=True, exist_ok=True)
        writable = os.access(saved.parent, os.W_OK)
    except OSError:
        writable = False
    if writable:
        dest = saved
    else:
        scratch = tempfile.mkdtemp(prefix="pdserve-tokenizer-")
        dest = pathlib.Path(scratch) / "converted"
    try:
        code = _convert_in_child(path, dest)
        if code != 0 or not dest.is_dir():
            raise RuntimeError(f"converting {path}'s tokenizer failed (exit code {code})")
        return AutoTokenizer.from_pretrained(str(dest), local_files_only=True)
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)


def convert_once(path: str) -> None:
    """Has the cache hold GGUF file `path`'s converted tokenizer, converted by a child process when it
    does not yet: what a router's supervisor does before it starts its workers, which would otherwise
    each start a conversion of their own. Best effort: on failure each worker tries for itself."""
    saved = converted_tokenizer_dir(path)
    if not saved.is_dir() and _convert_in_child(path, saved) != 0:
        log.warning("converting %s's tokenizer failed: each router worker tries for itself", path)


def _convert_in_child(path: str, dest: pathlib.Path) -> int:
    log.info("converting %s's tokenizer in a child process (torch is kept out of this one)", path)
    return subprocess.run([sys.executable, "-m", __name__, path, str(dest)]).returncode


def converted_tokenizer_dir(path: str) -> pathlib.Path:
    """Where the cache keeps `path`'s converted tokenizer. (transformers' version from its package's
    metadata: importing it costs a supervisor that never tokenizes half a second.)"""
    from importlib.metadata import version

    st = os.stat(path)
    key = f"{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}|{version('transformers')}"
    return cache_root() / "tokenizers" / hashlib.sha256(key.encode()).hexdigest()[:32]


def save_converted(tokenizer, saved: pathlib.Path) -> None:
    """Best effort: a read-only or full cache only costs the next start its conversion."""
    tmp = None
    try:
        saved.parent.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.mkdtemp(dir=saved.parent, prefix=".converting-")
        tokenizer.save_pretrained(tmp)
        os.rename(tmp, saved)  # atomic; fails when another process got there first
    except OSError as e:
        if not saved.is_dir():
            log.warning("cannot cache the converted tokenizer in %s: %s", saved, e)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)  # (gone once renamed)


def main(argv: list[str]) -> int:
    """`python -m pdserve.common.gguf_tokenizer GGUF DEST`: converts GGUF's tokenizer into folder DEST,
    and parses the file's metadata into the cache, which the router asks next (2 s a process else)."""
    from pdserve.common.gguf_checkpoint import read_info

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    path, dest = argv
    save_converted(_convert(path), pathlib.Path(dest))
    read_info(path)
    return 0 if pathlib.Path(dest).is_dir() else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
