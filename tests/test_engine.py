"""The engine end to end on a tiny model: seeded sampling, stops, logprobs, aborts, KV accounting."""

import pytest

from pdserve.common.types import FinishReason, SamplingParams

SAMPLED = dict(temperature=0.9, top_k=40, top_p=0.95, min_p=0.01, max_new_tokens=24, ignore_eos=True)


def test_seeded_sampling_is_reproducible_across_engines(make_engine):
    params = SamplingParams(seed=42, **SAMPLED)
    first = make_engine("qwen3").generate(["Hello there"], params)[0].output_ids
    second = make_engine("qwen3").generate(["Hello there"], params)[0].output_ids
    assert first == second and len(first) == 24


def test_seeded_sampling_does_not_depend_on_the_rest_of_the_batch(make_engine):
    engine = make_engine("llama", max_running_requests=16)
    target = ("Once upon a time", SamplingParams(seed=7, **SAMPLED))
    alone = engine.generate([target[0]], [target[1]])[0].output_ids
    others = [(f"filler prompt number {i} " * (i + 1), SamplingParams(seed=100 + i, **SAMPLED)) for i in range(9)]
    for position in (0, 4, 9):
        batch = others[:position] + [target] + others[position:]
        outs = engine.generate([p for p, _ in batch], [s for _, s in batch])
        assert outs[position].output_ids == alone
    # ... and with a different batch size limit, so the batch is cut differently
    small = make_engine("llama", max_running_requests=3)
    outs = small.generate([p for p, _ in others + [target]], [s for _, s in others + [target]])
    assert outs[-1].output_ids == alone


def test_different_seeds_give_different_samples(make_engine):
    engine = make_engine("gpt2")
    outs = engine.generate(["abc"] * 4, [SamplingParams(seed=s, **SAMPLED) for s in range(4)])
    assert len({tuple(o.output_ids) for o in outs}) == 4


def test_unseeded_requests_draw_seeds_from_random_seed(make_engine):
    params = SamplingParams(**SAMPLED)
    a = make_engine("llama", random_seed=5).generate(["x", "y"], params)
    b = make_engine("llama", random_seed=5).generate(["x", "y"], params)
    assert [o.output_ids for o in a] == [o.output_ids for o in b]


def test_max_tokens_and_ignore_eos(make_engine):
    engine = make_engine("qwen2")
    [out] = engine.generate(["hi"], SamplingParams(max_new_tokens=5, temperature=0, ignore_eos=True))
    assert len(out.output_ids) == 5 and out.finish_reason is FinishReason.LENGTH


def test_stop_token_ids_stop_and_stay_in_output_ids_but_not_text(make_engine):
    engine = make_engine("llama")
    [free] = engine.generate(["The"], SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True))
    stop_at = free.output_ids[3]
    first = free.output_ids.index(stop_at)
    [out] = engine.generate(
        ["The"], SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True, stop_token_ids=(stop_at,))
    )
    assert out.output_ids == free.output_ids[: first + 1]
    assert out.finish_reason is FinishReason.STOP and out.matched_stop == stop_at
    assert out.text == engine.tokenizer.decode(free.output_ids[:first], skip_special_tokens=True)


def test_stop_strings_cut_the_text(make_engine):
    engine = make_engine("mistral")
    [free] = engine.generate(["Tell me"], SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True))
    assert len(free.text) >= 6, free.text
    stop = free.text[3:6]
    cut = free.text.index(stop)
    [out] = engine.generate(
        ["Tell me"], SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True, stop=(stop,))
    )
    assert out.text == free.text[:cut] and out.finish_reason is FinishReason.STOP and out.matched_stop == stop
    [kept] = engine.generate(
        ["Tell me"],
        SamplingParams(
            max_new_tokens=16, temperature=0, ignore_eos=True, stop=(stop,), include_stop_str_in_output=True
        ),
    )
    assert kept.text == free.text[: cut + len(stop)]


def test_min_tokens_holds_back_eos(make_engine):
    engine = make_engine("gpt2")
    eos = engine.eos_token_ids
    outs = engine.generate(
        ["a"] * 8, [SamplingParams(max_new_tokens=10, min_new_tokens=10, temperature=1.0, seed=s) for s in range(8)]
    )
    for out in outs:
        assert len(out.output_ids) == 10 and not set(out.output_ids) & set(eos)


def test_logprobs_are_consistent_with_the_sampled_tokens(make_engine):
    engine = make_engine("qwen3")
    [out] = engine.generate(["hello"], SamplingParams(max_new_tokens=6, temperature=0, logprobs=3, ignore_eos=True))
    assert len(out.logprobs) == 6
    for token, lp in zip(out.output_ids, out.logprobs):
        assert lp.token_id == token and lp.logprob <= 0
        assert len(lp.top) == 3 and lp.top[0][0] == token  # greedy: the sampled token is the top one
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
    [plain] = engine.generate(["hello"], SamplingParams(max_new_tokens=2, temperature=0))
    assert plain.logprobs is None


def test_abort_mid_generation_frees_everything(make_engine):
    engine = make_engine("llama", max_running_requests=4)
    params = SamplingParams(max_new_tokens=50, temperature=0, ignore_eos=True)
    rids = [engine.add_request(engine.tokenizer("abc")["input_ids"], params) for _ in range(6)]
    for _ in range(5):
        engine.step()
    assert engine.stats()["kv_used_tokens"] > 0
    aborted = [engine.abort(rid) for rid in rids[::2]]
    assert all(c.finish_reason is FinishReason.ABORT for c in aborted)
    finished = []
    while engine.has_work():
        finished += engine.step()
    assert sorted(c.rid for c in finished) == sorted(rids[1::2])
    assert engine.is_idle()


def test_bad_requests_are_refused_and_leave_nothing_queued(make_engine):
    engine = make_engine("llama", context_length=64)
    with pytest.raises(ValueError, match="context length"):
        engine.generate(["x" * 10], SamplingParams(max_new_tokens=60))
    with pytest.raises(ValueError, match="out of range"):
        engine.generate([[1, 2, 10**6]], SamplingParams(max_new_tokens=2))
    with pytest.raises(ValueError, match="empty"):
        engine.generate([[]], SamplingParams(max_new_tokens=2))
    assert engine.is_idle()


def test_sampling_params_validation():
    for bad in (
        dict(max_new_tokens=-1),
        dict(temperature=-1),
        dict(top_p=0),
        dict(top_k=-2),
        dict(min_p=2),
        dict(logprobs=21),
        dict(min_new_tokens=5, max_new_tokens=2),
        dict(stop=("",)),
    ):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def test_requests_sharing_a_long_prefix_report_exact_cached_tokens(make_engine):
    engine = make_engine("llama", page_size=16)
    prefix = [engine.tokenizer.bos_token_id] + list(range(10, 109))  # 100 tokens
    greedy = SamplingParams(max_new_tokens=4, temperature=0)
    [first] = engine.generate([prefix + [200, 201]], greedy)
    [second] = engine.generate([prefix + [300, 301, 302]], greedy)
    [again] = engine.generate([prefix + [300, 301, 302]], greedy)
    assert first.cached_tokens == 0
    assert second.cached_tokens == 96  # the 6 whole pages of the shared 100 tokens
    assert again.cached_tokens == 96  # second cached 106 tokens: still 6 whole pages
    assert again.output_ids == second.output_ids


def test_run_batch_reports_cached_tokens_in_usage(tiny_models, tmp_path):
    import json
    import subprocess
    import sys

    prefix = "The same long system prompt, repeated for every request in this batch. " * 4
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    with open(src, "w") as f:
        for i in range(3):
            body = {"prompt": prefix + f"question {i}?", "max_tokens": 3, "temperature": 0}
            f.write(json.dumps({"custom_id": f"q{i}", "method": "POST", "url": "/v1/completions", "body": body}) + "\n")
    cmd = [
        sys.executable,
        "-m",
        "pdserve.common.cli",
        "run-batch",
        "-i",
        str(src),
        "-o",
        str(dst),
        "--model-path",
        tiny_models("qwen2"),
        "--device",
        "cpu",
        "--max-running-requests",
        "1",
        "--max-total-tokens",
        "4096",
        "--page-size",
        "8",
    ]
    subprocess.run(cmd, check=True, timeout=300)
    usages = [json.loads(line)["response"]["body"]["usage"] for line in dst.read_text().splitlines()]
    cached = [u["prompt_tokens_details"]["cached_tokens"] for u in usages]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_models("qwen2"))
    ids = [tok(prefix + f"question {i}?")["input_ids"] for i in range(3)]
    common = next(n for n in range(len(ids[0])) if ids[0][n] != ids[1][n])
    assert common > 40
    assert cached == [0, common // 8 * 8, common // 8 * 8]  # whole pages of the shared tokens


def test_run_batch_cli_reports_bad_arguments_clearly(tiny_models, tmp_path):
    import subprocess
    import sys

    base = [sys.executable, "-m", "pdserve.common.cli", "run-batch", "-o", str(tmp_path / "out.jsonl")]
    missing = subprocess.run(
        base + ["-i", str(tmp_path / "nope.jsonl"), "--model-path", tiny_models("llama")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert missing.returncode == 2 and "does not exist" in missing.stderr
    (tmp_path / "in.jsonl").write_text("")
    bad_model = subprocess.run(
        base + ["-i", str(tmp_path / "in.jsonl"), "--model-path", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad_model.returncode == 2 and "config.json" in bad_model.stderr


def test_mem_fraction_static_is_refused_on_cpu(tiny_models):
    from pdserve.common.engine.engine import Engine

    with pytest.raises(ValueError, match="sizes GPU memory"):
        Engine(model_path=tiny_models("llama"), device="cpu", mem_fraction_static=0.5)


# The Triton case runs through the interpreter (slow): short prompts, few tokens.
@pytest.mark.parametrize(
    "arch,backend,chunk,lens,new",
    [
        ("llama", "torch_native", 2048, (5, 17, 40), 12),
        ("gpt2", "torch_native", 2048, (5, 17, 40), 12),
        ("llama", "triton", 32, (5, 17), 4),
    ],
)
def test_warmup_leaves_the_pools_and_the_outputs_as_they_were(make_engine, arch, backend, chunk, lens, new):
    """The server start's dummy prefills (run on CUDA) touch only the reserved slot and pad row."""
    params = SamplingParams(max_new_tokens=new, temperature=0, ignore_eos=True)
    prompts = [list(range(3, 3 + n)) for n in lens]
    reference = [c.output_ids for c in make_engine(arch, attention_backend=backend).generate(prompts, params)]
    engine = make_engine(arch, attention_backend=backend)
    kv_pool, rows = engine.runner.kv_pool, engine.runner.req_to_token_pool
    free_pages, free_rows, table = kv_pool.num_free_pages(), rows.available(), rows.req_to_token.clone()
    assert engine.runner.warmup(chunk_tokens=chunk) > 0
    assert (kv_pool.num_free_pages(), rows.available()) == (free_pages, free_rows)
    assert bool((rows.req_to_token == table).all())
    assert [c.output_ids for c in engine.generate(prompts, params)] == reference
