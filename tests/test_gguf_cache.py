"""A GGUF file's weights saved dequantized for the next start (common/engine/models/gguf_cache.py): the
second load reads them and dequantizes nothing, the model is bitwise the first one's, and the cache
keeps to its bound, skips what it may not save and recovers from a damaged entry."""

import gguf
import pytest
import torch

from pdserve.common.engine.models import gguf_cache
from pdserve.common.engine.models.gguf_weights import GGUFWeights
from pdserve.common.engine.models.loader import load_model
from pdserve.common.tiny_model import make_tiny_model
from tests.tiny_gguf import write_gguf


@pytest.fixture
def tiny_gguf(tmp_path):
    """arch -> a Q8_0 .gguf of the tiny model (alone in its folder)."""

    def make(arch: str) -> str:
        checkpoint = make_tiny_model(tmp_path / arch, arch, 0)
        folder = tmp_path / f"{arch}-gguf"
        folder.mkdir()
        return str(write_gguf(checkpoint, folder / f"tiny-{arch}.Q8_0.gguf", gguf.GGMLQuantizationType.Q8_0))

    return make


@pytest.fixture
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(gguf_cache.LIMIT_ENV, raising=False)
    return tmp_path / "cache" / "gguf-weights"


def entries(folder) -> list:
    return sorted(folder.glob("*.safetensors")) if folder.exists() else []


def state(model) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items()}


def no_dequantizing(monkeypatch):
    def refuse(*_):
        raise AssertionError("dequantized again: the saved weights were not read")

    monkeypatch.setattr(GGUFWeights, "get_tensor", refuse)
    monkeypatch.setattr(GGUFWeights, "get_slice", refuse)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])  # (gpt2: Conv1D tensors, stored transposed in the file)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_second_load_reads_the_saved_weights_and_gives_the_same_model(
    arch, dtype, tiny_gguf, own_cache, monkeypatch
):
    path = tiny_gguf(arch)
    first = state(load_model(path, dtype, "cpu"))
    assert len(entries(own_cache)) == 1
    with monkeypatch.context() as m:
        no_dequantizing(m)
        second = state(load_model(path, dtype, "cpu"))
    assert first.keys() == second.keys()
    for key in first:
        assert first[key].dtype == second[key].dtype == dtype and torch.equal(first[key], second[key]), key
    other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
    load_model(path, other, "cpu")  # another dtype: its own entry
    assert len(entries(own_cache)) == 2


def test_nothing_is_saved_when_the_cache_is_off_or_the_weights_exceed_it(tiny_gguf, own_cache, monkeypatch):
    path = tiny_gguf("llama")
    monkeypatch.setenv(gguf_cache.LIMIT_ENV, "0")
    load_model(path, torch.float32, "cpu")
    assert entries(own_cache) == []
    monkeypatch.setenv(gguf_cache.LIMIT_ENV, "0.0001")  # ~100 KB: less than the tiny model's weights
    load_model(path, torch.float32, "cpu")
    assert entries(own_cache) == []


def test_the_least_recently_used_entry_goes_past_the_bound(tiny_gguf, own_cache, monkeypatch):
    llama, gpt2 = tiny_gguf("llama"), tiny_gguf("gpt2")
    load_model(llama, torch.float32, "cpu")
    (kept,) = entries(own_cache)
    size = kept.stat().st_size
    monkeypatch.setenv(gguf_cache.LIMIT_ENV, str(1.5 * size / 2**30))  # room for the larger one alone
    load_model(gpt2, torch.float32, "cpu")
    remaining = entries(own_cache)
    assert len(remaining) == 1 and remaining[0] != kept, "the older entry should have gone"
    assert remaining[0] == gguf_cache.entry_path(gpt2, torch.float32)


def test_a_damaged_entry_is_dropped_and_the_file_dequantized_again(tiny_gguf, own_cache):
    path = tiny_gguf("llama")
    first = state(load_model(path, torch.float32, "cpu"))
    (entry,) = entries(own_cache)
    entry.write_bytes(entry.read_bytes()[:100])  # cut short
    again = state(load_model(path, torch.float32, "cpu"))
    assert all(torch.equal(first[k], again[k]) for k in first)
    (rewritten,) = entries(own_cache)
    assert rewritten.stat().st_size > 100
