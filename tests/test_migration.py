"""Which choices move to another decode server when theirs fails, and as what request (router/migration.py).
The moves themselves, between real processes: tests/test_faults.py."""

from pdserve.common.types import SamplingParams
from pdserve.router.migration import resumed, why_not


def test_a_choice_resumes_with_its_sent_tokens_as_prompt_and_the_rest_of_its_budget():
    params = SamplingParams(max_new_tokens=10, min_new_tokens=4, temperature=0, prompt_logprobs=2, logprobs=1)
    prompt, left = resumed([1, 2, 3], [7, 8, 9], params)
    assert prompt == [1, 2, 3, 7, 8, 9]
    assert (left.max_new_tokens, left.min_new_tokens, left.prompt_logprobs, left.logprobs) == (7, 1, None, 1)
    _, done_min = resumed([1], [5] * 6, params)
    assert done_min.min_new_tokens == 0 and done_min.max_new_tokens == 4


def test_only_choices_another_server_can_continue_exactly_are_moved():
    assert why_not(SamplingParams(temperature=0)) is None  # greedy
    assert why_not(SamplingParams(temperature=0.7)) is None  # sampled, no seed of the client's
    assert why_not(SamplingParams(temperature=0, seed=5)) is None  # a seed changes nothing in greedy
    assert why_not(SamplingParams(temperature=0, repetition_penalty=1.3)) is None  # prompt and output: carried
    assert "grammar" in why_not(SamplingParams(grammar=("json_object", "")))
    assert "penalties" in why_not(SamplingParams(frequency_penalty=0.5))
    assert "penalties" in why_not(SamplingParams(presence_penalty=0.5))
    assert "seed" in why_not(SamplingParams(temperature=0.7, seed=5))
