"""A decode server prefilling requests itself on CUDA (GenerateRequest.local_prefill): its prefill
chunks run eagerly beside its decode CUDA graphs; fp32 greedy equals transformers, mixed with
disaggregated requests whose KV arrives by NIXL (VRAM)."""

import time

from pdserve.common.config import EngineConfig
from pdserve.common.types import SamplingParams
from pdserve.decode.engine import DecodeEngine
from pdserve.prefill.engine import PrefillEngine
from tests.test_disagg_engines import Stepper, drive, hf_greedy, make_prompts


def test_local_and_remote_prefills_on_cuda_match_transformers(tiny_models):
    path = tiny_models("llama")
    base = dict(model_path=path, device="cuda", dtype="float32", max_total_tokens=8192, page_size=16)
    prefill = PrefillEngine(EngineConfig(**base), "prefill-cuda-local", kv_transfer_timeout=30)
    decode = DecodeEngine(EngineConfig(**base, chunked_prefill_size=64), "decode-cuda-local", kv_transfer_timeout=30)
    assert decode.runner.cuda_graphs is not None
    prompts = make_prompts(8, seed=11) + [[0] + list(range(5, 205))]  # the last one: several chunks
    expected = hf_greedy(path, prompts, 10, device="cuda")
    params = SamplingParams(max_new_tokens=10, temperature=0)
    local = [i for i in range(len(prompts)) if i % 2 == 0]
    for i in local:
        decode.add_local_request(prompts[i], params, rid=f"l{i}")
    remote = [prompts[i] for i in range(len(prompts)) if i % 2 == 1]
    completions, _ = drive(prefill, decode, remote, [params] * len(remote))
    loop, deadline = Stepper(decode), time.monotonic() + 60
    while decode.busy():
        assert time.monotonic() < deadline
        for c in loop.step():
            completions[c.rid] = c
    got = [completions[f"l{i}"] if i % 2 == 0 else completions[f"r{i // 2}"] for i in range(len(prompts))]
    assert [c.output_ids for c in got] == expected
    assert decode.is_idle() and prefill.is_idle()
