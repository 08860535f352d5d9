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

# The longest files first: `make test` hands files to its two workers in collection order
# (--no-loadscope-reorder; xdist's own order, most tests first, left the slowest files of few tests to
# the end, where one worker can be left running the last of them alone). Seconds per file from
# `pytest --durations=0` on the 2-core box (2026-11-29); a file missing here only runs later, in its
# usual order.
SLOWEST_FILES = """
    test_servers 103   test_triton_backend 91   test_transfer_faults 65   test_router_torch_free 55
    test_parity 54   test_gguf 52   test_bench 52   test_tp 52   test_router_workers 51
    test_router_hostile 50   test_faults 50   test_api_fuzz 45   test_speculative_engine 43
    test_tp_disagg 43   test_fp8_kv_cache 42   test_grammar 42   test_structured_outputs 38
    test_triton_kernels 36   test_router_overload 35   test_speculative_draft 31   test_real_model_stack 30
    test_generate_many 30   test_router_reliability 30   test_engine 23   test_disagg_policy 22
    test_rope_store 22   test_deploy 20   test_spec_itl 19
""".split()[::2]


def pytest_collection_modifyitems(items):
    rank = {f"{name}.py": i for i, name in enumerate(SLOWEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's own order kept
