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


# The longest test files (seconds of a 2-core run, `--durations=0` summed per file), heaviest first.
# NOTE: `--dist loadfile` hands files to the two workers in collection order, so a long file collected
# last (test_triton_backend.py: 75 s) would run while the other worker sits idle. Collected first, the
# run ends on short files instead. A file missing here only runs in its alphabetical place.
HEAVY_FIRST = (
    "test_servers.py",  # 111 s
    "test_triton_backend.py",  # 75
    "test_router_hostile.py",  # 54
    "test_router_workers.py",  # 52
    "test_grammar.py",  # 50
    "test_parity.py",  # 48
    "test_bench.py",  # 45
    "test_tp_disagg.py",  # 44
    "test_tp.py",  # 41
    "test_real_model_stack.py",  # 41
    "test_structured_outputs.py",  # 39
    "test_gguf.py",  # 39
    "test_speculative_engine.py",  # 38
    "test_router_reliability.py",  # 36
    "test_router_overload.py",  # 36
    "test_api_fuzz.py",  # 32
    "test_generate_many.py",  # 31
    "test_fp8_kv_cache.py",  # 30
)


def pytest_collection_modifyitems(config, items):
    """Heavy files first (HEAVY_FIRST); each file's tests stay together and in their order."""
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # (stable: the rest keep their order)
