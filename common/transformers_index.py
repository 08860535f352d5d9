"""transformers' index of its own models, built once per installed copy and cached.

transformers 5 makes its top-level module lazy, and to know what it can hand out it reads every model
file's `__all__` at import (`utils.import_utils.define_import_structure` over `models/`: ~1,700 files
opened and scanned line by line), again in every process. On the CI box that is ~1 s of a core of the
~1.8 s `import transformers` costs, in each router, scheduler, TP worker and `pdserve up` (the CPU
suite starts ~150 of them). The index depends only on the files, so it is kept in the cache
(common/cache.py, `transformers-index/`), keyed by transformers' version, the folder and every file's
size and mtime under it (a ~15 ms walk with no file opened), and read back as the same dict.

`install()` (common/__init__.py calls it) puts a finder at the head of `sys.meta_path` that waits for
transformers to load `utils.import_utils` and wraps its `define_import_structure`, then removes
itself; nothing else of transformers is touched, and any surprise (another signature, a result of
another shape, an unreadable cache) falls back to transformers' own function.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.abc
import importlib.machinery
import json
import logging
import os
import sys

log = logging.getLogger(__name__)

_MODULE = "transformers.utils.import_utils"


def install() -> None:
    """Cache transformers' model index from here on (before transformers is imported; after, or
    twice, it does nothing)."""
    if _MODULE in sys.modules or any(isinstance(f, _Finder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _Finder())


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            build = getattr(module, "define_import_structure", None)
            if callable(build):
                module.define_import_structure = _cached(build)

        spec.loader.exec_module = exec_module
        return spec


def _cached(build):
    # NOTE every failure of the cache (no home folder to put it in, a read-only one, a torn or foreign
    # file, a call or a result of a shape not seen here) falls back to transformers' own function:
    # hence the broad excepts, in a function that runs inside `import transformers`.
    @functools.wraps(build)  # (__wrapped__: transformers' own)
    def define_import_structure(*args, **kwargs):
        try:
            path = _cache_file(*_arguments(*args, **kwargs))
        except Exception:
            return build(*args, **kwargs)
        try:
            return _decode(json.loads(path.read_text()))
        except Exception:
            pass
        structure = build(*args, **kwargs)
        try:
            _write(path, _encode(structure))
        except Exception as e:
            log.debug("transformers' index not cached (%s): %s", path, e)
        return structure

    return define_import_structure


def _arguments(module_path, prefix=None) -> tuple[str, str | None]:
    if prefix is not None and not isinstance(prefix, str):
        raise TypeError(prefix)
    return os.fspath(module_path), prefix


def _cache_file(module_path: str, prefix: str | None):
    """Where the index of this folder (a file stands for its folder, as in transformers) lives,
    named after everything it is made from."""
    from pdserve.common.cache import cache_root

    folder = os.path.dirname(module_path) if os.path.isfile(module_path) else module_path
    version = getattr(sys.modules.get("transformers"), "__version__", "")
    key = hashlib.sha256(f"{version}\0{os.path.realpath(folder)}\0{prefix}\0".encode())
    _fingerprint(folder, key)
    return cache_root() / "transformers-index" / f"{key.hexdigest()[:32]}.json"


def _fingerprint(folder: str, key) -> None:
    with os.scandir(folder) as entries:
        for entry in sorted(entries, key=lambda e: e.name):
            if entry.is_dir(follow_symlinks=False):
                if entry.name != "__pycache__":
                    _fingerprint(entry.path, key)
            elif entry.name.endswith(".py"):
                stat = entry.stat()
                key.update(f"{entry.path}\0{stat.st_mtime_ns}\0{stat.st_size}\0".encode())


def _encode(structure: dict) -> list:
    """{frozenset(backends): {module: set(names)}} as JSON: [[backends], {module: [names]}] pairs."""
    return [[sorted(backends), {module: sorted(names) for module, names in modules.items()}]
            for backends, modules in structure.items()]  # fmt: skip


def _decode(encoded: list) -> dict:
    return {frozenset(backends): {module: set(names) for module, names in modules.items()}
            for backends, modules in encoded}  # fmt: skip


def _write(path, encoded: list) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_suffix(f".{os.getpid()}.part")
    part.write_text(json.dumps(encoded))
    os.replace(part, path)  # (processes starting side by side: each writes whole files)
