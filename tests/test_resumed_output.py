"""A request whose prompt ends with output an earlier server produced (SamplingParams.resumed_output_tokens:
a stream moved off a failed decode server, router/migration.py) goes on exactly as the uninterrupted run:
a grammar starts past that output, frequency/presence penalties count it, a seed's noise keeps its steps.
Colocated, and through a prefill/decode pair (the prefill server samples the first token after the
move, the decode server the rest). The move between real processes: tests/test_faults.py."""

import json
from dataclasses import replace
from types import SimpleNamespace

import pytest

from pdserve.common.errors import ErrorCode
from pdserve.common.types import FinishReason, SamplingParams
from pdserve.router.migration import resumed
from tests.test_disagg_engines import drive, engines

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "tags"],
}
GRAMMAR = ("json_schema", json.dumps(SCHEMA))
PROMPT = [5, 6, 7, 8, 9]
SENT = 6  # tokens the client had before the move
CASES = {
    "grammar": SamplingParams(max_new_tokens=30, temperature=0, grammar=GRAMMAR),
    "penalties": SamplingParams(max_new_tokens=24, temperature=0, frequency_penalty=2.0, presence_penalty=1.5),
    "seeded": SamplingParams(max_new_tokens=24, temperature=1.0, seed=1234),
    # Everything at once, min_tokens past the move too.
    "all": SamplingParams(
        max_new_tokens=30, min_new_tokens=10, temperature=0.8, seed=7, frequency_penalty=0.5, grammar=GRAMMAR
    ),
}


def moved(generate, params: SamplingParams) -> tuple[list[int], list[int]]:
    """(the uninterrupted run's output, the output when the run moves after SENT tokens)."""
    whole = generate(PROMPT, params)
    assert len(whole) > SENT + 3, whole  # (something left to continue)
    prompt, left = resumed(PROMPT, whole[:SENT], params)
    assert left.resumed_output_tokens == SENT
    return whole, whole[:SENT] + generate(prompt, left)


@pytest.mark.parametrize("case", list(CASES))
def test_a_moved_request_continues_as_the_uninterrupted_run(make_engine, case):
    engine = make_engine("llama")

    def generate(prompt, params):
        [c] = engine.generate([prompt], params)
        assert c.error is None, c.error
        return c.output_ids

    whole, moved_ids = moved(generate, CASES[case])
    assert moved_ids == whole


def test_a_moved_request_continues_as_the_uninterrupted_run_through_a_prefill_decode_pair(tiny_models):
    """The prefill server samples the first token after the move (its step is SENT, its grammar past the
    replayed output), the decode server accepts that token after the replay and goes on."""
    prefill, decode = engines(tiny_models("llama"))
    runs = iter(range(100))

    def generate(prompt, params):
        completions, results = drive(prefill, decode, [prompt], [params], seed=next(runs))
        assert results["r0"].error is None and completions["r0"].error is None
        return completions["r0"].output_ids

    for case in ("grammar", "all"):
        whole, moved_ids = moved(generate, CASES[case])
        assert moved_ids == whole, case
    assert prefill.is_idle() and decode.is_idle()


@pytest.mark.parametrize("overlap", [True, False])
def test_a_moved_request_continues_as_the_uninterrupted_run_with_speculative_decoding(make_engine, overlap):
    """Verify steps sample each draft position at its step after the move: overlapped (the steps moved on
    the device, common/engine/speculative/overlap.py) and serial (penalties read the tokens)."""
    from tests.test_speculative_engine import BASE, Oracle, assert_speculated, watch

    prompts = [PROMPT, [0, *PROMPT * 3]]
    seeded = replace(CASES["seeded"], max_new_tokens=32, ignore_eos=True)
    # (a penalty makes the batch's verify steps serial: reading the tokens, they wait for the step before)
    params = [seeded, replace(seeded, temperature=0.7, seed=3, frequency_penalty=0.0 if overlap else 1.0)]
    whole = [c.output_ids for c in make_engine("gpt2", **BASE).generate(prompts, params)]
    moved_reqs = [resumed(p, w[:SENT], q) for p, w, q in zip(prompts, whole, params)]
    engine = make_engine("gpt2", speculative="ngram", disable_overlap_schedule=not overlap, **BASE)
    answers = [SimpleNamespace(output_ids=w[SENT:]) for w in whole]  # (drafts: these, one in three wrong)
    engine.scheduler.speculation.proposer = Oracle([p for p, _ in moved_reqs], answers)
    checked = watch(engine)
    rest = engine.generate([p for p, _ in moved_reqs], [q for _, q in moved_reqs])
    assert [w[:SENT] + c.output_ids for w, c in zip(whole, rest)] == whole
    assert_speculated(engine)
    assert (checked["moved"] > 0) == overlap, checked


def test_resumed_output_must_leave_a_prompt_before_it(make_engine):
    engine = make_engine("llama")
    with pytest.raises(ValueError, match=r"resumed_output_tokens \(3\) must be less than the prompt's length \(3\)"):
        engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=2, resumed_output_tokens=3))
    with pytest.raises(ValueError, match="resumed_output_tokens must be an integer >= 0"):
        SamplingParams(resumed_output_tokens=-1)
    [c] = engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=2, temperature=0, resumed_output_tokens=2))
    assert c.error is None and len(c.output_ids) == 2


def test_resumed_output_the_grammar_refuses_fails_the_request_as_a_bad_one(make_engine):
    """A JSON grammar cannot start with the tokens of "hello": the request fails with the reason, INVALID_REQUEST
    (the client's input), and frees its KV (make_engine checks)."""
    engine = make_engine("llama")
    bad = engine.tokenizer("hello", add_special_tokens=False)["input_ids"]
    params = SamplingParams(max_new_tokens=4, temperature=0, grammar=GRAMMAR, resumed_output_tokens=len(bad))
    [c] = engine.generate([PROMPT + bad], params)
    assert c.finish_reason is FinishReason.ABORT and c.error_code is ErrorCode.INVALID_REQUEST
    assert "output before the stream moved (resumed_output_tokens)" in c.error and "outside" in c.error
    # The same output, as the request's own grammar-valid start instead, runs.
    ok = engine.tokenizer('{"name"', add_special_tokens=False)["input_ids"]
    [c] = engine.generate([PROMPT + ok], replace(params, resumed_output_tokens=len(ok)))
    assert c.error is None, c.error
