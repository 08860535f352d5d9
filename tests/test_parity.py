"""Greedy output is token-identical to Hugging Face transformers (fp32, CPU) for every architecture.

36 prompts of mixed lengths (1 to 120 tokens; page boundaries and Mistral's 48-token sliding
window crossed) with mixed max_new_tokens, so requests finish at different steps and the batch
composition keeps changing. Run through the Python API at batch sizes 1 to 32 and through the
`pdserve run-batch` command in a separate process.
"""

import json
import random
import subprocess
import sys

import pytest
import torch

from pdserve.common.config import short_model_name
from pdserve.common.tiny_model import ARCHS
from pdserve.common.types import FinishReason, SamplingParams

PROMPT_LENS = [
    1,
    2,
    3,
    5,
    7,
    8,
    9,
    15,
    16,
    17,
    23,
    31,
    32,
    33,
    40,
    47,
    50,
    63,
    64,
    65,
    70,
    90,
    100,
    120,
    4,
    6,
    11,
    13,
    19,
    24,
    28,
    36,
    44,
    49,
    55,
    80,
]


def make_prompts(vocab_size: int, bos: int, num_special: int) -> list[tuple[list[int], int]]:
    rng = random.Random(1234)
    prompts = []
    for n in PROMPT_LENS:
        ids = [bos] + [rng.randrange(num_special, vocab_size) for _ in range(n - 1)]
        prompts.append((ids, rng.randint(4, 24)))
    return prompts


@pytest.fixture(scope="module", params=ARCHS)
def reference(request, tiny_models):
    """(arch, checkpoint, [(prompt_ids, max_new_tokens, hf_output_ids)])."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    arch = request.param
    path = tiny_models(arch)
    tok = AutoTokenizer.from_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32).eval()
    cases = []
    for ids, max_new in make_prompts(hf.config.vocab_size, tok.bos_token_id, len(tok.all_special_ids)):
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([ids]), max_new_tokens=max_new, do_sample=False, pad_token_id=tok.pad_token_id
            )
        cases.append((ids, max_new, out[0, len(ids) :].tolist()))
    return arch, path, cases


@pytest.mark.parametrize("batch_size", [1, 3, 8, 32])
def test_greedy_matches_transformers_through_the_python_api(reference, make_engine, batch_size):
    arch, _, cases = reference
    engine = make_engine(arch, max_running_requests=batch_size)
    sizes = record_batch_sizes(engine)
    outs = engine.generate(
        [ids for ids, _, _ in cases], [SamplingParams(max_new_tokens=n, temperature=0) for _, n, _ in cases]
    )
    for (ids, max_new, expected), out in zip(cases, outs):
        assert out.output_ids == expected, f"{arch} bs={batch_size} prompt of {len(ids)} tokens"
        assert out.finish_reason is (
            FinishReason.LENGTH
            if len(expected) == max_new and expected[-1] not in engine.eos_token_ids
            else FinishReason.STOP
        )
        assert out.text == engine.tokenizer.decode(
            [t for t in out.output_ids if t not in engine.eos_token_ids], skip_special_tokens=True
        )
    assert max(sizes) == batch_size and min(sizes) == 1, "the batch filled up, then drained"


# Engine settings that each force one scheduling path, and the counter proving it was taken.
MODES = {
    "chunked": (dict(chunked_prefill_size=16, page_size=4), "prefill_chunks"),
    "retract": (
        dict(max_total_tokens=400, context_length=160, num_reserved_decode_tokens=1, page_size=4),
        "retractions",
    ),
    "odd_pages_lpm": (dict(page_size=7, schedule_policy="lpm", chunked_prefill_size=50), "prefill_chunks"),
    "no_cache": (dict(disable_radix_cache=True, page_size=1), None),
    # The same paths through the serial loop (the default loop above is the overlapped one).
    "serial": (dict(disable_overlap_schedule=True), None),
    "serial_chunked_retract": (
        dict(
            disable_overlap_schedule=True,
            chunked_prefill_size=16,
            max_total_tokens=400,
            context_length=160,
            num_reserved_decode_tokens=1,
            page_size=4,
        ),
        "retractions",
    ),
    "overlap_chunked_retract": (
        dict(
            chunked_prefill_size=16,
            max_total_tokens=400,
            context_length=160,
            num_reserved_decode_tokens=1,
            page_size=4,
            serial_consecutive_prefill=True,
        ),
        "retractions",
    ),
}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_greedy_matches_transformers_in_every_scheduling_mode(reference, make_engine, mode):
    arch, _, cases = reference
    settings, counter = MODES[mode]
    engine = make_engine(arch, max_running_requests=32, **settings)
    params = [SamplingParams(max_new_tokens=n, temperature=0) for _, n, _ in cases]
    outs = engine.generate([ids for ids, _, _ in cases], params)
    assert [o.output_ids for o in outs] == [expected for _, _, expected in cases], f"{arch} {mode}"
    if counter is not None:
        assert engine.scheduler.stats[counter] > 0, f"{mode} never took its path"
    if mode == "no_cache" or "retract" in mode:  # a 400-token pool keeps nothing for long
        return
    # The same prompts again: now their prefixes come from the radix cache.
    hits_before = engine.scheduler.stats["cache_hit_tokens"]
    outs = engine.generate([ids for ids, _, _ in cases], params)
    assert [o.output_ids for o in outs] == [expected for _, _, expected in cases], f"{arch} {mode} cached"
    assert engine.scheduler.stats["cache_hit_tokens"] > hits_before
    assert sum(o.cached_tokens for o in outs) > 0


def record_batch_sizes(engine) -> list[int]:
    sizes = []
    schedule = engine.scheduler.get_next_batch_to_run

    def recording():
        batch = schedule()
        if batch is not None:
            sizes.append(batch.batch_size)
        return batch

    engine.scheduler.get_next_batch_to_run = recording
    return sizes


def test_greedy_matches_transformers_through_run_batch(reference, tmp_path):
    arch, path, cases = reference
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    with open(src, "w") as f:
        for i, (ids, max_new, _) in enumerate(cases):
            body = {"prompt": ids, "max_tokens": max_new, "temperature": 0, "return_token_ids": True}
            f.write(json.dumps({"custom_id": f"p{i}", "method": "POST", "url": "/v1/completions", "body": body}) + "\n")
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
        path,
        "--device",
        "cpu",
        "--max-running-requests",
        "7",
        "--max-total-tokens",
        "8192",
    ]
    subprocess.run(cmd, check=True, timeout=300)
    lines = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [line["custom_id"] for line in lines] == [f"p{i}" for i in range(len(cases))]
    for line, (ids, max_new, expected) in zip(lines, cases):
        assert line["response"]["status_code"] == 200, line
        body = line["response"]["body"]
        [choice] = body["choices"]
        assert choice["token_ids"] == expected and choice["prompt_token_ids"] == ids
        usage = body["usage"]
        assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (
            len(ids),
            len(expected),
            len(ids) + len(expected),
        )
        assert body["model"] == short_model_name(path)
