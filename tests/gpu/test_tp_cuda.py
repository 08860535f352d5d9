"""Tensor parallelism on CUDA (NCCL). On two GPUs: tp=2 fp32 greedy parity with transformers, the
decode and prefill CUDA graphs capturing the all-reduces and the LM head's all-gather (skipped with
fewer). On one GPU: a size-1 NCCL group in every layer, so the same collectives run through
ProcessGroupNCCL inside the graphs."""

import random

import pytest
import torch

from pdserve.common.engine import tp as tp_module
from pdserve.common.engine.engine import Engine
from pdserve.common.ports import free_port
from pdserve.common.tiny_model import make_tiny_model
from pdserve.common.types import SamplingParams
from tests.test_disagg_engines import hf_greedy

two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")


def prompts(n, vocab, seed=0):
    rng = random.Random(seed)
    return [[0] + [rng.randrange(5, vocab) for _ in range(rng.randrange(1, 90))] for _ in range(n)]


@two_gpus
@pytest.mark.parametrize(
    "arch,overrides",
    [("llama", None), ("qwen3", None), ("gpt2", None), ("llama", {"num_key_value_heads": 1, "vocab_size": 509})],
)
@pytest.mark.parametrize("overlap", [True, False])
def test_tp2_greedy_on_two_gpus_agrees_with_transformers(tmp_path, tiny_models, arch, overrides, overlap):
    path = tiny_models(arch) if overrides is None else str(make_tiny_model(tmp_path / arch, arch, 0, overrides))
    vocab = (overrides or {}).get("vocab_size", 512)
    cases = prompts(24, vocab)
    expected = hf_greedy(path, cases, 16, device="cuda")
    engine = Engine(
        model_path=path,
        device="cuda",
        dtype="float32",
        tp_size=2,
        max_total_tokens=16384,
        chunked_prefill_size=32,
        disable_overlap_schedule=not overlap,
    )
    try:
        assert engine.runner.cuda_graphs is not None and engine.runner.prefill_graphs is not None
        got = [c.output_ids for c in engine.generate(cases, SamplingParams(max_new_tokens=16, temperature=0))]
        assert got == expected
        assert engine.runner.cuda_graphs.replays > 0, "decode ran from CUDA graphs"
        again = [c.output_ids for c in engine.generate(cases, SamplingParams(max_new_tokens=16, temperature=0))]
        assert again == expected  # prefix-cache hits
        assert engine.is_idle()
    finally:
        engine.close()


@two_gpus
def test_tp2_symmetric_memory_all_reduce_keeps_parity(tiny_models):
    """--tp-all-reduce symm: the decode graphs' all-reduces by torch's symmetric-memory kernel; fp32
    greedy equals transformers. It is set up once per process: a second engine here runs on NCCL
    (its fresh ranks told so by rank 0), with the same tokens."""
    path = tiny_models("llama")
    cases = prompts(24, 512, seed=5)
    params = SamplingParams(max_new_tokens=16, temperature=0)
    expected = hf_greedy(path, cases, 16, device="cuda")
    for symmetric in (True, False):
        engine = Engine(
            model_path=path, device="cuda", dtype="float32", tp_size=2, max_total_tokens=16384, tp_all_reduce="symm"
        )
        try:
            assert (engine.runner.tp.symmetric is not None) == symmetric
            assert [c.output_ids for c in engine.generate(cases, params)] == expected
            assert engine.runner.cuda_graphs.replays > 0
        finally:
            engine.close()


@two_gpus
def test_tp2_bf16_runs_and_mostly_agrees_with_tp1(tiny_models):
    path = tiny_models("llama")
    cases = prompts(32, 512, seed=3)
    params = SamplingParams(max_new_tokens=24, temperature=0)
    single = [
        c.output_ids for c in Engine(model_path=path, device="cuda", max_total_tokens=16384).generate(cases, params)
    ]
    engine = Engine(model_path=path, device="cuda", tp_size=2, max_total_tokens=16384)
    try:
        got = [c.output_ids for c in engine.generate(cases, params)]
    finally:
        engine.close()
    first = sum(g[:1] == s[:1] for g, s in zip(got, single)) / len(cases)
    print(f"\nbf16 tp=2 vs tp=1: first-token agreement {first:.2%}")
    assert first >= 0.75  # bf16 sums in a different order: not bitwise


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_nccl_collectives_captured_in_cuda_graphs_keep_parity_on_one_gpu(tiny_models, monkeypatch, arch):
    """Every TPGroup.single becomes a real one-rank NCCL group: each layer's all-reduce, the LM head's
    all-gather and the start-up MIN go through ProcessGroupNCCL, eagerly and inside the graphs."""

    def one_rank_nccl(device):
        port = free_port()
        store = tp_module.TPGroup.serve_store(1, port, 60)
        return tp_module.TPGroup.join(0, 1, tp_module.rank_device(str(device), 0), port, 60, store=store)

    monkeypatch.setattr(tp_module.TPGroup, "single", staticmethod(one_rank_nccl))
    path = tiny_models(arch)
    cases = prompts(24, 512)
    expected = hf_greedy(path, cases, 16, device="cuda")
    engine = Engine(model_path=path, device="cuda", dtype="float32", max_total_tokens=16384, chunked_prefill_size=32)
    assert engine.runner.tp.backend is not None and engine.runner.prefill_graphs is not None
    got = [c.output_ids for c in engine.generate(cases, SamplingParams(max_new_tokens=16, temperature=0))]
    assert got == expected
    assert engine.runner.cuda_graphs.replays > 0 and engine.runner.prefill_graphs.replays > 0
