"""Shared fixtures: tiny checkpoints built once per session, engines that must end idle."""

import gc
import os

import torch

# NOTE: before anything imports a Triton kernel module: Triton reads TRITON_INTERPRET when a
# @triton.jit function is defined, so without a GPU the kernels run in its interpreter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from pdserve.common.tiny_model import ARCHS, make_tiny_model  # noqa: E402

# The real-model fixture (SmolLM2 GGUF and its transformers reference), for any test module.
pytest_plugins = ("tests.real_model",)


@pytest.fixture(autouse=True, scope="session")
def private_cache(tmp_path_factory):
    """pdserve's cache (common/cache.py: converted tokenizers, parsed GGUF metadata, random weights, the
    real model's transformers reference) in a folder of this test run's own, for the processes the tests
    start too: nothing of a test's lands in ~/.cache.

    NOTE: one folder for all of a run's xdist workers (beside their own temporary folders), so what one
    worker converts the other reuses: each entry is written aside and renamed into place (or, for the
    reference, under a lock), so workers filling it at once never see half of one."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent / "pdserve-cache" if os.environ.get("PYTEST_XDIST_WORKER") else base / "pdserve-cache"
    root.mkdir(exist_ok=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PDSERVE_CACHE", str(root))
        yield


@pytest.fixture(autouse=True)
def unfreeze_gc():
    """Engines freeze the heap they start with (gc.freeze); a test's dropped engines, caught in
    that heap, must still be collectable once the test is over."""
    yield
    gc.unfreeze()


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """arch -> checkpoint directory, each built on first use."""
    root = tmp_path_factory.mktemp("tiny")
    built = {}

    def get(arch: str) -> str:
        if arch not in built:
            built[arch] = str(make_tiny_model(root / arch, arch, seed=0))
        return built[arch]

    return get


@pytest.fixture
def make_engine(tiny_models):
    """Engine factory; every engine it made must be idle (all KV rows and pages free) at teardown."""
    from pdserve.common.engine.engine import Engine

    engines = []

    def make(arch: str = "llama", **overrides):
        overrides.setdefault("device", "cpu")
        overrides.setdefault("max_total_tokens", 16384)
        engine = Engine(model_path=tiny_models(arch), **overrides)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        assert engine.is_idle(), f"KV leaked: {engine.stats()}"


ALL_ARCHS = ARCHS
