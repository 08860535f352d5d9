"""As what request a choice moves to another decode server when its own fails (router/migration.py).
That the servers continue such a request exactly: tests/test_resumed_output.py; the moves themselves,
between real processes: tests/test_faults.py."""

from pdserve.common.types import SamplingParams
from pdserve.router.migration import resumed


def test_a_choice_resumes_with_its_sent_tokens_as_prompt_and_the_rest_of_its_budget():
    params = SamplingParams(max_new_tokens=10, min_new_tokens=4, temperature=0, prompt_logprobs=2, logprobs=1)
    prompt, left = resumed([1, 2, 3], [7, 8, 9], params)
    assert prompt == [1, 2, 3, 7, 8, 9]
    assert (left.max_new_tokens, left.min_new_tokens, left.prompt_logprobs, left.logprobs) == (7, 1, None, 1)
    _, done_min = resumed([1], [5] * 6, params)
    assert done_min.min_new_tokens == 0 and done_min.max_new_tokens == 4


def test_the_sent_tokens_are_marked_as_output_already_produced():
    """Whatever the request's parameters (a grammar, output-only penalties, a seed): the servers continue it
    from the count of output tokens it carries (SamplingParams.resumed_output_tokens)."""
    params = SamplingParams(
        max_new_tokens=10, temperature=0.7, seed=5, frequency_penalty=0.5, grammar=("json_object", "")
    )
    prompt, left = resumed([1, 2, 3], [7, 8, 9], params)
    assert left.resumed_output_tokens == 3 and prompt[-3:] == [7, 8, 9]
    assert (left.seed, left.frequency_penalty, left.grammar) == (5, 0.5, ("json_object", ""))
    assert resumed(prompt, [4], left)[1].resumed_output_tokens == 4  # (a request moved again counts on)
