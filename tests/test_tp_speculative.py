"""Speculative decoding with tensor parallelism on CPU (gloo, tp = 2): transformers' greedy tokens.

Rank 0 proposes (n-gram, or the draft model it alone holds) and samples every position of a verify step;
the other ranks run the same verify forward from its plan and keep the same FutureMap (bonus tokens and
accepted counts), so an overlapped verify step's positions move alike on every rank. Each test asserts
drafts were proposed and accepted, so none passes with speculation off.
"""

from types import SimpleNamespace

import pytest

from pdserve.common.types import SamplingParams
from tests.test_disagg_engines import hf_greedy
from tests.test_speculative_draft import other_draft  # noqa: F401 - a fixture
from tests.test_speculative_engine import PROMPTS, Oracle, assert_speculated, spec_stats
from tests.test_tp import engines_ending_idle

TP2 = dict(device="cpu", tp_size=2, max_total_tokens=4096, page_size=4, chunked_prefill_size=16)
GREEDY = SamplingParams(max_new_tokens=24, temperature=0)


@pytest.fixture
def tp_engines():
    yield from engines_ending_idle(TP2)


def test_ngram_and_oracle_drafts_at_tp2_give_transformers_tokens(tiny_models, tp_engines):
    """Overlapped verify steps (their positions moved on the device by the step before's accepted count,
    on both ranks), n-gram drafts and then drafts accepted and rejected at every position."""
    path = tiny_models("llama")
    expected = hf_greedy(path, PROMPTS, 24)
    engine = tp_engines(path, speculative="ngram", speculative_overlap="on")
    assert [c.output_ids for c in engine.generate(PROMPTS, GREEDY)] == expected
    assert spec_stats(engine)["spec_proposed_tokens"] > 0
    engine.scheduler.speculation.proposer = Oracle(PROMPTS, [SimpleNamespace(output_ids=e) for e in expected])
    assert [c.output_ids for c in engine.generate(PROMPTS, GREEDY)] == expected
    assert_speculated(engine)
    stats = spec_stats(engine)
    assert stats["spec_overlapped_steps"] > 0 and stats["spec_accepted_tokens"] >= sum(map(len, expected)) // 4


def test_a_draft_model_at_tp2_gives_transformers_tokens(tiny_models, other_draft, tp_engines):  # noqa: F811
    """The draft model runs whole on rank 0; the serial loop (the overlapped one is above)."""
    path = tiny_models("llama")
    expected = hf_greedy(path, PROMPTS, 24)
    engine = tp_engines(path, speculative="draft", draft_model_path=other_draft("llama"), disable_overlap_schedule=True)
    assert [c.output_ids for c in engine.generate(PROMPTS, GREEDY)] == expected
    assert_speculated(engine)
    assert engine.proposer.is_idle()
