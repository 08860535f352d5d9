"""Grammar-constrained sampling on CUDA: decode batches replay CUDA graphs, the sampling of a
grammar batch is launched after the previous batch is processed (a mask uploaded from pinned memory
on the forward stream); the outputs validate, and overlapped equals serial equals CPU."""

import json

import pytest

from pdserve.common.engine.engine import Engine
from tests.test_grammar import SCHEMA, _batch


def check(record: dict) -> None:
    """SCHEMA's rules, by hand (jsonschema is not on the GPU machines)."""
    assert set(record) == set(SCHEMA["required"])
    assert isinstance(record["name"], str) and len(record["name"]) <= 5
    assert type(record["age"]) is int and 0 <= record["age"] <= 120
    assert 1 <= len(record["tags"]) <= 3 and set(record["tags"]) <= {"a", "b", "c"}


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_grammar_outputs_on_cuda_validate_and_equal_cpu(arch, tiny_models):
    path = tiny_models(arch)
    prompts = [[5, 6, 7], [9] * 40, [11, 12], [40, 41, 42, 43]] * 4
    params = _batch(len(prompts))
    outs = {}
    for overlap in (True, False):
        engine = Engine(
            model_path=path,
            device="cuda",
            dtype="float32",
            max_total_tokens=16384,
            disable_overlap_schedule=not overlap,
        )
        assert engine.runner.cuda_graphs is not None
        outs[overlap] = [c.output_ids for c in engine.generate(prompts, params)]
        for c in engine.generate(prompts, params):
            check(json.loads(c.text))
        assert engine.is_idle()
    cpu = Engine(model_path=path, device="cpu", max_total_tokens=16384)
    assert outs[True] == outs[False] == [c.output_ids for c in cpu.generate(prompts, params)]
