"""Speculative decoding's policy (common/scheduling/draft_policy.py) and metrics: no drafts in decode steps
larger than --speculative-max-batch (and the overlapped loop back for them), k lowered for a request whose
drafts are rejected and raised again as they are accepted; the tokens are the plain engine's whatever the
policy does. The scheduler's counters as Prometheus series (common/serving/server_metrics.py)."""

import pytest

from pdserve.common.scheduling.draft_policy import OVERLAP_MIN_HELD, DraftPolicy
from pdserve.common.scheduling.proposer import Proposer
from pdserve.common.scheduling.speculation import Speculation
from pdserve.common.serving import ipc
from pdserve.common.serving.server_metrics import Metrics
from pdserve.common.types import Req, SamplingParams
from tests.test_speculative_engine import BASE, PROMPTS, Oracle, assert_speculated, watch


def test_the_policy_lowers_k_on_rejections_never_below_1_and_raises_it_back():
    policy, req, other = DraftPolicy(4), Req("a", [0, 1], SamplingParams(), 0), Req("b", [0, 1], SamplingParams(), 0)
    depths = []
    for proposed, accepted in [(4, 0), (2, 0), (1, 0), (1, 0), (1, 1), (2, 2), (3, 3), (4, 4), (4, 2)]:
        depths.append(policy.depth(req))
        assert depths[-1] >= proposed  # (what it was offered, at most)
        policy.record(req, proposed, accepted)
    assert depths == [4, 2, 1, 1, 1, 2, 3, 4, 4]
    assert policy.depth(req) == 3  # half accepted: the average 0.72, 2.9 drafts
    policy.record(req, 0, 0)  # a step it had no drafts in changes nothing
    assert policy.depth(req) == 3 and policy.depth(other) == 4
    assert policy.depth(Req("a", [0, 1], SamplingParams(), 0)) == 4  # the same rid, another request
    policy.retain([other])
    assert policy.acceptance == {} and policy.depth(req) == 4
    fixed = DraftPolicy(4, adaptive=False)
    fixed.record(req, 4, 0)
    assert fixed.depth(req) == 4
    assert [DraftPolicy(4, max_batch=2).speculates(b) for b in (1, 2, 3)] == [True, True, False]
    assert DraftPolicy(4, max_batch=0).speculates(10**6)


def test_a_guess_is_asked_for_where_the_next_step_may_ride_on_it():
    """DraftPolicy.may_guess: never with overlap off; always for an overlapped step or with overlap on;
    with auto, for a request whose drafts are accepted at least OVERLAP_MIN_HELD of the time (its guess can
    hold that often at most: a draft model feeds its last draft back only then)."""
    req = Req("a", [0, 1], SamplingParams(), 0)
    assert not DraftPolicy(4, overlap="off").may_guess(req, overlapped=False)
    assert DraftPolicy(4, overlap="on").may_guess(req, overlapped=False)
    auto = DraftPolicy(4, overlap="auto")
    assert auto.may_guess(req, overlapped=False)  # (before its first verify step: rate 1)
    auto.record(req, 4, 4)
    assert auto.may_guess(req, overlapped=False)
    auto.record(req, 4, 1)
    assert auto.rate(req) < OVERLAP_MIN_HELD and not auto.may_guess(req, overlapped=False)
    assert auto.may_guess(req, overlapped=True)


def test_a_serial_step_that_kept_only_some_drafts_counts_as_a_failed_guess():
    """With auto, a serial step's result tells whether an overlapped step after it would have held: never
    where it kept only some drafts (no guess needed), else the proposer's guess against the bonus token
    (unknown where the proposer did not compute one: no observation)."""

    class Guesses(Proposer):
        hypothesizes = True

        def guess_after(self, req, drafts):
            return {(1, 2): 7}.get(tuple(drafts))

    spec = Speculation(Guesses(), None, 4096, (), DraftPolicy(4, overlap="auto"))
    req = Req("a", [0, 1], SamplingParams(), 0)
    assert spec._would_hold(req, [1, 2], 1, 5) is False and spec._would_hold(req, [3, 4], 0, 5) is False
    assert spec._would_hold(req, [1, 2], 2, 7) is True and spec._would_hold(req, [1, 2], 2, 8) is False
    assert spec._would_hold(req, [3, 4], 2, 7) is None  # (no guess computed)
    assert Speculation(Guesses(), None, 4096, (), DraftPolicy(4, overlap="on"))._would_hold(req, [1, 2], 2, 7) is None


class WrongUntil(Oracle):
    """Each request's plain answer as drafts, every one wrong (the first draft too: none accepted) while
    the request has fewer output tokens than `wrong_until[i]` (its prompt's). It drafts only from the tokens
    the host has (no `propose_after`): its verify steps run serially, so each step's k follows every
    earlier step's acceptance (overlapped, k would lag a step)."""

    hypothesizes = False

    def __init__(self, prompts, completions, wrong_until):
        super().__init__(prompts, completions, right=True)
        self.wrong_until = {tuple(p): n for p, n in zip(prompts, wrong_until)}

    def propose_for(self, req, limit: int) -> list[int]:
        drafts = super().propose_for(req, limit)
        if len(req.output_ids) < self.wrong_until[tuple(req.prompt_ids)]:
            drafts = [(t + 1) % 512 for t in drafts]
        return drafts


def draft_counts(engine) -> dict[str, list[int]]:
    """rid -> the number of drafts each verify step gave it."""
    spec, counts = engine.scheduler.speculation, {}
    verify_batch = spec.verify_batch

    def counted(reqs, ends, writes):
        batch = verify_batch(reqs, ends, writes)
        for req, drafts in zip(batch.reqs if batch is not None else [], batch.drafts if batch is not None else []):
            counts.setdefault(req.rid, []).append(len(drafts))
        return batch

    spec.verify_batch = counted
    return counts


@pytest.mark.parametrize("fixed_k", [False, True])
def test_k_follows_each_requests_acceptance_and_the_tokens_stay_the_plain_ones(make_engine, fixed_k):
    """Request 0's drafts are right, request 1's wrong until its 12th token, then right: request 1 is
    offered 4, 2, then 1 draft while they are rejected, and 2, 3, 4 as they are accepted again; request
    0 always 4 (until max_tokens leaves none). --speculative-fixed-k: 4 for both throughout."""
    p = SamplingParams(max_new_tokens=32, temperature=0, ignore_eos=True)
    prompts = PROMPTS[:2]
    plain = make_engine("llama", **BASE).generate(prompts, p)
    engine = make_engine("llama", speculative="ngram", speculative_fixed_k=fixed_k, **BASE)
    engine.scheduler.speculation.proposer = WrongUntil(prompts, plain, wrong_until=[0, 12])
    counts = draft_counts(engine)
    watch(engine)
    outs = engine.generate(prompts, p)
    assert [c.output_ids for c in outs] == [c.output_ids for c in plain]
    assert_speculated(engine)
    right, recovering = (counts[c.rid] for c in outs)
    assert right == [4] * 6 + [0]  # 1 + 5 a step to 31 tokens, then nothing left to draft (as one of a verify step)
    if fixed_k:
        assert recovering == [4] * 15  # 1 token a step while wrong (to 12), then 5
    else:
        # 1 token a step to 12 as k goes 4, 2, 1; from 12 on 2, 3, 4, 5, 5 (k 1, 2, 3, 4) until 32
        assert recovering == [4, 2] + [1] * 10 + [2, 3, 4, 4]


@pytest.mark.parametrize("overlap", [True, False])
def test_no_drafts_above_the_batch_limit_and_the_loop_overlaps_there(make_engine, overlap):
    """--speculative-max-batch 2, four requests: steps of 3 or 4 requests are plain decode steps (with
    overlap on they overlap again: a launch before the previous batch's results), steps of 1 or 2 verify;
    the tokens are the plain engine's."""
    p = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)
    params = [SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True) for n in (6, 10, 20, 24)]
    plain = make_engine("gpt2", **BASE).generate(PROMPTS, p)
    engine = make_engine(
        "gpt2", speculative="ngram", speculative_max_batch=2, disable_overlap_schedule=not overlap, **BASE
    )
    engine.scheduler.speculation.proposer = Oracle(PROMPTS, plain)
    sizes = []  # (requests, verify?) of each decode step
    decode_step = engine.scheduler.decode_step

    def recorded():
        batch = decode_step()
        if batch is not None:
            sizes.append((batch.batch_size, batch.drafts is not None))
        return batch

    engine.scheduler.decode_step = recorded
    watch(engine)
    outs = engine.generate(PROMPTS, params)
    assert [c.output_ids for c in outs] == [c.output_ids[: n.max_new_tokens] for c, n in zip(plain, params)]
    assert_speculated(engine)
    assert {b for b, verify in sizes if verify} == {1, 2}
    assert {b for b, verify in sizes if not verify} >= {3, 4}
    at = {event: i for i, event in enumerate(engine.trace)}
    launches = [s for kind, s in engine.trace if kind == "launch"]
    overlapped = [s for s in launches[:-1] if at["launch", s + 1] < at["process", s]]
    assert bool(overlapped) == overlap


def test_a_step_under_the_limit_after_plain_steps_in_flight_stays_plain_where_it_cannot_overlap(make_engine):
    """--speculative-max-batch 2, four requests, two of which end early and one with penalties: while all four
    run, the plain steps overlap; the step where the two that reached max_tokens still wait for their last
    token leaves two requests, under the limit, after plain steps in flight, and the penalized one cannot be
    in an overlapped verify step: that step is a plain one (it once raised). The tokens are the plain engine's."""
    params = [SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True) for n in (6, 6, 20)]
    params.append(SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True, repetition_penalty=1.3))
    plain = make_engine("gpt2", **BASE).generate(PROMPTS, params)
    engine = make_engine("gpt2", speculative="ngram", speculative_max_batch=2, **BASE)
    engine.scheduler.speculation.proposer = Oracle(PROMPTS, plain)
    watch(engine)
    assert [c.output_ids for c in engine.generate(PROMPTS, params)] == [c.output_ids for c in plain]
    assert_speculated(engine)
    assert engine.is_idle()


def test_the_speculation_counters_are_prometheus_series_with_the_mean_accepted_length():
    metrics = Metrics("decode")
    value = metrics.registry.get_sample_value
    labels = {"role": "decode", "proposer": "ngram"}
    totals = dict(spec_verify_steps=10, spec_proposed_tokens=40, spec_accepted_tokens=24, spec_verified_requests=16)
    metrics.update(ipc.LoadReport(1, 0, 10, 100, 0, speculation={"ngram": totals}))
    assert value("pdserve_spec_verify_steps_total", labels) == 10
    assert value("pdserve_spec_accepted_tokens_total", labels) == 24
    assert value("pdserve_spec_mean_accepted_length", labels) == 1 + 24 / 16
    later = dict(spec_verify_steps=14, spec_proposed_tokens=50, spec_accepted_tokens=27, spec_verified_requests=22)
    later |= dict(spec_overlapped_steps=9, spec_unconfirmed_tokens=5)  # (overlapped verify steps since)
    metrics.update(ipc.LoadReport(1, 0, 10, 100, 0, speculation={"ngram": later}))
    assert value("pdserve_spec_proposed_tokens_total", labels) == 50
    assert value("pdserve_spec_verified_requests_total", labels) == 22
    assert value("pdserve_spec_overlapped_steps_total", labels) == 9
    assert value("pdserve_spec_unconfirmed_tokens_total", labels) == 5
    assert value("pdserve_spec_mean_accepted_length", labels) == 1 + 3 / 6  # the steps since the last report
    metrics.update(ipc.LoadReport(1, 0, 10, 100, 0, speculation={"ngram": later}))  # no verify step since
    assert value("pdserve_spec_mean_accepted_length", labels) == 1 + 3 / 6
    assert value("pdserve_spec_accepted_tokens_total", labels) == 27
    # the report crosses the process boundary
    report = ipc.LoadReport(1, 0, 10, 100, 0, speculation={"ngram": later})
    assert ipc.decode_to_frontend(ipc.encode(report)) == report
