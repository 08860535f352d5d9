"""Speculative decoding on CUDA: verify steps (eager, Triton's extend kernels) between plain decode steps
replayed from CUDA graphs, on the overlap loop's streams; fp32 greedy equals transformers and the plain
engine, seeded sampling equals the plain engine, colocated and on a decode server whose KV came by NIXL."""

import pytest

from pdserve.common.config import EngineConfig
from pdserve.common.engine.engine import Engine
from pdserve.common.types import SamplingParams
from pdserve.decode.engine import DecodeEngine
from pdserve.prefill.engine import PrefillEngine
from tests.test_disagg_engines import drive, hf_greedy
from tests.test_speculative_engine import PROMPTS, Oracle, assert_speculated, watch

CUDA = dict(device="cuda", dtype="float32", max_total_tokens=8192, page_size=16)


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt2"])
def test_verify_steps_on_cuda_give_the_plain_tokens(tiny_models, arch, overlap):
    path = tiny_models(arch)
    greedy = SamplingParams(max_new_tokens=24, temperature=0)
    sampled = SamplingParams(max_new_tokens=24, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True)
    expected = hf_greedy(path, PROMPTS, 24, device="cuda")
    plain_engine = Engine(model_path=path, disable_overlap_schedule=not overlap, **CUDA)
    assert plain_engine.runner.cuda_graphs is not None
    plain = plain_engine.generate(PROMPTS, greedy)
    plain_sampled = plain_engine.generate(PROMPTS, sampled)
    assert [c.output_ids for c in plain] == expected
    engine = Engine(model_path=path, speculative="ngram", disable_overlap_schedule=not overlap, **CUDA)
    assert [c.output_ids for c in engine.generate(PROMPTS, greedy)] == expected
    engine.scheduler.speculation.proposer = Oracle(PROMPTS, plain_sampled)
    watch(engine)
    assert [c.output_ids for c in engine.generate(PROMPTS, sampled)] == [c.output_ids for c in plain_sampled]
    assert_speculated(engine)
    assert engine.is_idle()


def test_a_decode_server_speculates_on_kv_written_by_nixl_on_cuda(tiny_models):
    path = tiny_models("qwen3")
    expected = hf_greedy(path, PROMPTS, 24, device="cuda")
    prefill = PrefillEngine(EngineConfig(model_path=path, **CUDA), "prefill-cuda-spec", kv_transfer_timeout=30)
    decode = DecodeEngine(
        EngineConfig(model_path=path, speculative="ngram", **CUDA), "decode-cuda-spec", kv_transfer_timeout=30
    )
    completions, _ = drive(prefill, decode, PROMPTS, [SamplingParams(max_new_tokens=24, temperature=0)] * 4)
    assert [completions[f"r{i}"].output_ids for i in range(len(PROMPTS))] == expected
    assert_speculated(decode)
    assert decode.is_idle() and prefill.is_idle()
