"""bench/micro/teacher_forced_engine.py on a tiny model: the plain engine equals transformers fp32 at every
position, and the FP8 KV cache moves the logprobs (it ran, it was not skipped)."""

import json

from pdserve.bench.micro import teacher_forced_engine


def test_plain_agrees_everywhere_and_fp8_kv_moves_the_logprobs(tiny_models, tmp_path):
    out = tmp_path / "tf.json"
    args = ["--model-path", tiny_models("llama"), "--device", "cpu", "--dtype", "float32", "--limit", "2"]
    assert teacher_forced_engine.main(args + ["--configs", "plain,fp8kv-chunk32", "--output-json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert results["plain"]["agreement"] == 1.0 and results["plain"]["positions"] > 100
    assert results["plain"]["max_abs_logprob_diff"] < 1e-3
    assert results["fp8kv-chunk32"]["positions"] == results["plain"]["positions"]
    assert results["fp8kv-chunk32"]["max_abs_logprob_diff"] > 1e-3
