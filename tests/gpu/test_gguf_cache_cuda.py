"""A GGUF file's weights saved dequantized (common/engine/models/gguf_cache.py), read back on CUDA: the
second engine maps the saved file through the pinned staging copies and dequantizes nothing, and gives
the first one's greedy tokens under CUDA graphs."""

import gguf
import pytest

from pdserve.common.engine.engine import Engine
from pdserve.common.engine.models import gguf_cache
from pdserve.common.engine.models.gguf_weights import GGUFWeights
from pdserve.common.types import SamplingParams
from tests.tiny_gguf import write_gguf


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_saved_gguf_weights_serve_the_same_tokens_on_cuda(dtype, tiny_models, tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(gguf_cache.LIMIT_ENV, raising=False)
    path = write_gguf(tiny_models("llama"), tmp_path / "tiny.Q8_0.gguf", gguf.GGMLQuantizationType.Q8_0)
    cases = [[0, 5, 9, 33, 7], [0] + list(range(40, 90))]
    params = [SamplingParams(max_new_tokens=12, temperature=0)] * len(cases)
    first = Engine(model_path=str(path), device="cuda", dtype=dtype, max_total_tokens=8192)
    want = [c.output_ids for c in first.generate(cases, params)]
    first.close()
    assert list((tmp_path / "cache" / "gguf-weights").glob("*.safetensors")), "nothing was saved"

    def refuse(*_):
        raise AssertionError("dequantized again: the saved weights were not read")

    monkeypatch.setattr(GGUFWeights, "get_tensor", refuse)
    monkeypatch.setattr(GGUFWeights, "get_slice", refuse)
    second = Engine(model_path=str(path), device="cuda", dtype=dtype, max_total_tokens=8192)
    assert second.runner.cuda_graphs is not None
    assert [c.output_ids for c in second.generate(cases, params)] == want
    second.close()
