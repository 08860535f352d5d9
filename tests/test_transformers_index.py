"""common/transformers_index.py: transformers' model index read from the cache gives the same lazy
module as transformers builds, is keyed by the files it is made from, and survives a bad cache."""

import json
import os
import subprocess
import sys
import textwrap

from pdserve.common import transformers_index

# In a fresh process: how many folders transformers indexed itself (its lru-cached builder), and a
# digest of the lazy module it made. CACHED: pdserve.common imported first, as in every pdserve
# process; else transformers alone (torch hidden in both, as in the router).
CHILD = textwrap.dedent(
    """
    import hashlib, json, sys
    if CACHED:
        import pdserve.common
    sys.modules["torch"] = None
    import transformers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    import transformers.utils.import_utils as iu

    def plain(value):
        if isinstance(value, dict):
            return sorted((json.dumps(plain(k)), plain(v)) for k, v in value.items())
        if isinstance(value, (set, frozenset, list, tuple)):
            return sorted(json.dumps(plain(v)) for v in value)
        return repr(value)

    module = sys.modules["transformers"]
    lazy = {name: plain(getattr(module, name)) for name in
            ("_import_structure", "_class_to_module", "_modules", "_object_missing_backend", "__all__")}
    print(json.dumps({"built": iu.create_import_structure_from_path.cache_info().currsize,
                      "lazy": hashlib.sha256(json.dumps(lazy).encode()).hexdigest(),
                      "tokenizer": AutoTokenizer.__name__ + PreTrainedTokenizerFast.__name__}))
    """
)


def run_child(cache, cached=True) -> dict:
    env = {**os.environ, "PDSERVE_CACHE": str(cache)}
    code = f"CACHED = {cached}\n" + CHILD
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_process_reading_the_index_gets_transformers_own_lazy_module(tmp_path):
    own = run_child(tmp_path, cached=False)
    assert own["built"] > 0 and not (tmp_path / "transformers-index").exists()
    first = run_child(tmp_path)  # builds as transformers does, and caches
    assert first == own
    files = list((tmp_path / "transformers-index").glob("*.json"))
    assert files
    assert run_child(tmp_path) == {**own, "built": 0}  # nothing read from transformers' files

    for f in files:  # a torn or foreign cache: transformers builds it again, and it is rewritten whole
        f.write_text('[["torch"], {"models.x": ')
    assert run_child(tmp_path) == own
    assert all(isinstance(json.loads(f.read_text()), list) for f in files)


def test_the_key_follows_every_file_under_the_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "models" / "llama"
    folder.mkdir(parents=True)
    (folder / "configuration_llama.py").write_text("__all__ = ['LlamaConfig']\n")
    (folder / "__init__.py").write_text("")
    name = transformers_index._cache_file(str(folder.parent), "models")
    assert name == transformers_index._cache_file(str(folder.parent), "models")
    assert name != transformers_index._cache_file(str(folder.parent), None)
    # a file stands for its folder, as in transformers
    assert transformers_index._cache_file(str(folder / "__init__.py"), None) == transformers_index._cache_file(
        str(folder), None
    )
    (folder / "configuration_llama.py").write_text("__all__ = ['LlamaConfig', 'LlamaTextConfig']\n")
    assert transformers_index._cache_file(str(folder.parent), "models") != name  # size (and mtime) changed
    (folder / "tokenization_llama.py").write_text("")
    changed = transformers_index._cache_file(str(folder.parent), "models")
    os.utime(folder / "tokenization_llama.py", ns=(1, 1))
    assert transformers_index._cache_file(str(folder.parent), "models") != changed  # mtime alone


def test_the_encoding_round_trips_backends_modules_and_names():
    structure = {
        frozenset(): {"models.llama.configuration_llama": {"LlamaConfig"}},
        frozenset({"torch", "tokenizers"}): {"models.a.b": {"X", "Y"}, "models.c": set()},
    }
    assert transformers_index._decode(json.loads(json.dumps(transformers_index._encode(structure)))) == structure


def test_install_after_transformers_is_imported_does_nothing():
    import transformers.utils.import_utils  # noqa: F401 (the test process has it)

    before = list(sys.meta_path)
    transformers_index.install()
    assert sys.meta_path == before
