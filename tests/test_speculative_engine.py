"""Speculative decoding in the engine's decode path (common/scheduling/speculation.py,
common/engine/speculative/step.py): every token is the plain engine's, greedy and seeded, overlap on and
off, chunked prefill, prefix hits on KV that verify steps wrote, the disaggregated decode server; requests
finishing inside their accepted drafts; aborts and retraction free everything; the flags' refusals.

Every test asserts that drafts were proposed and accepted (the scheduler's spec_* counters), so none can
pass with speculation silently off. Two proposers: the engine's n-gram one on prompts with repeated
patterns, and an oracle that drafts the plain answer with one token in three wrong (tiny random models
rarely repeat themselves: the oracle puts accepted and rejected drafts at every position).
"""

import json
import shutil
from types import SimpleNamespace

import pytest

from pdserve.common.config import EngineConfig
from pdserve.common.engine.engine import Engine
from pdserve.common.scheduling.pages import pages_for
from pdserve.common.scheduling.proposer import Proposer
from pdserve.common.tiny_model import ARCHS
from pdserve.common.types import FinishReason, SamplingParams
from tests.test_disagg_engines import drive, engines, hf_greedy

# Rollbacks cross pages; prompts past 16 are chunked; verify steps overlap whenever they can (the default,
# auto, overlaps only while guesses hold: test_auto_overlaps_only_while_the_guesses_hold).
BASE = dict(page_size=4, chunked_prefill_size=16, speculative_overlap="on")
PROMPTS = [
    [0] + [5, 6, 7, 8, 9] * 6,
    [0] + [11, 12, 13] * 8 + [40, 41],
    [0, 100, 101, 102, 100, 101],
    [0] + list(range(200, 230)) + list(range(200, 215)),
]


def spec_stats(engine) -> dict:
    return {k: v for k, v in engine.scheduler.stats.items() if k.startswith("spec_")}


def assert_speculated(engine) -> None:
    stats = spec_stats(engine)
    assert stats["spec_proposed_tokens"] > 0 and stats["spec_accepted_tokens"] > 0, stats


class Oracle(Proposer):
    """Drafts each request's plain answer (keyed by prompt) with about one token in three wrong (none
    with `right`), the wrong ones fixed by (prompt, position): the same drafts whatever the batch."""

    hypothesizes = True  # (drafts after a step in flight too: the overlapped verify step)

    def __init__(self, prompts, completions, k: int = 4, right: bool = False):
        self.answers = {tuple(p): c.output_ids for p, c in zip(prompts, completions)}
        self.k, self.right = k, right

    def propose_for(self, req, limit: int) -> list[int]:
        return self._answer(req, len(req.output_ids), min(self.k, limit))

    def propose_after(self, req, extra, limit: int) -> list[int]:
        # (its first token guesses the in-flight step's last: wrong where the answer's token is made wrong)
        return self._answer(req, len(req.output_ids) + len(extra), min(self.k + 1, limit))

    def _answer(self, req, done: int, n: int) -> list[int]:
        drafts = self.answers[tuple(req.prompt_ids)][done : done + n]
        wrong = [(done + j) * 7 + len(req.prompt_ids) for j in range(len(drafts))]
        return [t if w % 3 or self.right else (t + 1) % 512 for t, w in zip(drafts, wrong)]


def watch(engine) -> dict:
    """Check the rollback after every verify step (kv_len is the tokens kept but the newest, and the
    request holds exactly the pages for them and for a step still in flight), and count requests that
    finished before the tokens a step accepted for them ran out, and overlapped steps."""
    spec, page = engine.scheduler.speculation, engine.config.page_size
    seen = {"mid_draft_finishes": 0, "verify_steps": 0, "overlapped": 0, "verify_batches": 0, "moved": 0}
    seen["dropped_drafts"] = 0  # drafts of steps whose request finished in the step before (or left) while they ran
    original = spec.process_result

    def process_result(batch, next_ids, logprobs, accepted):
        before = [len(r.output_ids) for r in batch.reqs]
        dropped = [r.discard > 0 for r in batch.reqs]  # (retracted or aborted while it ran)
        seen["dropped_drafts"] += sum(len(d) for d, gone in zip(batch.drafts, dropped) if gone)
        # (positions that moved on the device: the step before kept drafts)
        seen["moved"] += any(
            a and a.drafts and len(r.output_ids) > a.known + 1 for r, a in zip(batch.reqs, afters(batch))
        )
        done = original(batch, next_ids, logprobs, accepted)
        seen["verify_steps"] += any(batch.drafts)
        seen["verify_batches"] += 1  # (with drafts, or after a verify step whose drafts move its positions)
        seen["overlapped"] += batch.after is not None  # (scheduled while a step of its requests ran)
        for req, n, taken, gone in zip(batch.reqs, before, accepted, dropped):
            if gone or req.finish_reason is FinishReason.ABORT:
                continue
            if req.finished:
                seen["mid_draft_finishes"] += len(req.output_ids) - n < taken + 1
            else:
                # A step still in flight (overlapped) writes positions known - 1 .. known - 1 + its drafts.
                known = len(req.prompt_ids) + len(req.output_ids)
                assert req.kv_len == known - 1, (req, req.kv_len)
                held = known + req.spec_ahead if req.pending else req.kv_len
                assert len(req.pages) == pages_for(held, page), (req, len(req.pages))
        return done

    spec.process_result = process_result
    return seen


def afters(batch) -> list:
    return batch.after or [None] * len(batch.reqs)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_equals_the_plain_engine_and_transformers(make_engine, tiny_models, arch):
    """n-gram drafts, overlap on and off, and oracle drafts (accepted and rejected at every position):
    the plain engine's tokens, which are transformers' (to EOS, or 24)."""
    p = SamplingParams(max_new_tokens=24, temperature=0)
    expected = hf_greedy(tiny_models(arch), PROMPTS, 24)
    plain = make_engine(arch, **BASE).generate(PROMPTS, p)
    assert [c.output_ids for c in plain] == expected
    for overlap in (True, False):
        engine = make_engine(arch, speculative="ngram", disable_overlap_schedule=not overlap, **BASE)
        checked = watch(engine)
        assert [c.output_ids for c in engine.generate(PROMPTS, p)] == expected, overlap
        # (overlapped, n-gram drafts also guess the token in flight: on random weights they are seldom
        # accepted, the oracle below is)
        assert spec_stats(engine)["spec_proposed_tokens"] > 0
        assert checked["verify_steps"] == spec_stats(engine)["spec_verify_steps"]
        assert (checked["overlapped"] > 0) == overlap
    for overlap in (True, False):
        engine = make_engine(arch, speculative="ngram", disable_overlap_schedule=not overlap, **BASE)
        engine.scheduler.speculation.proposer = Oracle(PROMPTS, plain)
        checked = watch(engine)
        assert [c.output_ids for c in engine.generate(PROMPTS, p)] == expected
        assert_speculated(engine)
        assert spec_stats(engine)["spec_accepted_tokens"] >= sum(len(e) for e in expected) // 4
        assert (checked["overlapped"] > 0) == overlap


@pytest.mark.parametrize("overlap", [True, False])
def test_right_drafts_give_k_plus_one_tokens_a_step(make_engine, overlap):
    """Drafts all right (k = 4): each verify step keeps its 4 drafts and the token after them; the
    last one drafts only what max_tokens leaves (24 tokens: the prefill's, then 5 + 5 + 5 + 5 + 3),
    overlapped or not."""
    p = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)
    plain = make_engine("llama", **BASE).generate(PROMPTS[:1], p)
    engine = make_engine("llama", speculative="ngram", disable_overlap_schedule=not overlap, **BASE)
    engine.scheduler.speculation.proposer = Oracle(PROMPTS[:1], plain, right=True)
    checked = watch(engine)
    retired, retire = [], engine.scheduler._retire
    engine.scheduler._retire = lambda done: retired.extend(done) or retire(done)
    assert engine.generate(PROMPTS[:1], p)[0].output_ids == plain[0].output_ids
    # The request's own counts (a decode server's spans carry them): the prefill's step and 5 verify steps.
    assert [(r.sampled_steps, r.spec_proposed, r.spec_accepted) for r in retired] == [(6, 18, 18)]
    assert spec_stats(engine) == {
        "spec_verify_steps": 5,
        "spec_proposed_tokens": 18,
        "spec_accepted_tokens": 18,
        "spec_verified_requests": 5,
        "spec_unconfirmed_tokens": 0,
        # Overlapped, every verify step but the first was scheduled while the one before ran (and the first
        # while the prefill ran), its positions moved on the device by the 4 drafts that one kept; the sixth
        # (no drafts: max_tokens was reached) too, its result dropped.
        "spec_overlapped_steps": 6 if overlap else 0,
    }
    assert checked["overlapped"] == (6 if overlap else 0)


def test_auto_overlaps_only_while_the_guesses_hold(make_engine):
    """--speculative-overlap auto (the default): with drafts all right the guesses an overlapped step would
    ride on hold, judged on each serial step's result, and from a few steps on the verify steps overlap;
    with one draft in three wrong they would seldom hold, and the steps stay serial. The tokens are the
    plain engine's either way."""
    p = SamplingParams(max_new_tokens=64, temperature=0, ignore_eos=True)
    plain = make_engine("llama", **BASE).generate(PROMPTS, p)
    for right in (True, False):
        engine = make_engine("llama", speculative="ngram", **dict(BASE, speculative_overlap="auto"))
        engine.scheduler.speculation.proposer = Oracle(PROMPTS, plain, right=right)
        checked = watch(engine)
        assert [c.output_ids for c in engine.generate(PROMPTS, p)] == [c.output_ids for c in plain]
        assert_speculated(engine)
        assert (checked["overlapped"] > 0) == right, checked
        assert 0 < checked["overlapped"] < checked["verify_batches"] or not right  # (it started serial)


SAMPLED = [
    dict(temperature=0.8, top_p=0.9, seed=7),
    dict(temperature=0.6, top_k=20, seed=11, repetition_penalty=1.3, presence_penalty=1.0, frequency_penalty=0.5),
    dict(temperature=0.7, min_new_tokens=12, logit_bias=((9, 3.0),), seed=5, logprobs=2),
    dict(temperature=0.0, repetition_penalty=1.5, frequency_penalty=1.0),
]


@pytest.mark.parametrize("params", SAMPLED, ids=["top_p", "penalties", "min_tokens_bias_logprobs", "greedy_penalties"])
def test_seeded_sampling_gives_the_plain_engines_tokens(make_engine, params):
    """Verification is seed-exact: the same tokens (and logprobs) as the plain engine at any
    temperature, penalties seeing the drafts as output, overlapped verify steps included."""
    p = SamplingParams(max_new_tokens=24, ignore_eos=True, **params)
    plain = make_engine("gpt2", **BASE).generate(PROMPTS, p)
    for overlap in (True, False):
        engine = make_engine("gpt2", speculative="ngram", disable_overlap_schedule=not overlap, **BASE)
        engine.scheduler.speculation.proposer = Oracle(PROMPTS, plain)
        checked = watch(engine)
        spec = engine.generate(PROMPTS, p)
        assert [c.output_ids for c in spec] == [c.output_ids for c in plain]
        # Overlapped where sampling reads only the step (its noise keys made again on the device): not
        # with penalties or min_new_tokens, which run serially.
        assert (checked["moved"] > 0) == (overlap and p.reads_step_only)
        if p.logprobs is not None:  # (the extend kernels' float sums differ from decode's in the last bits)
            for a, b in zip(spec, plain):
                assert [lp.token_id for lp in a.logprobs] == [lp.token_id for lp in b.logprobs]
                assert [lp.logprob for lp in a.logprobs] == pytest.approx([lp.logprob for lp in b.logprobs], abs=1e-4)
        assert_speculated(engine)


def test_a_prefix_hit_on_kv_that_verify_steps_wrote(make_engine):
    """A second turn (prompt + answer + more) reuses the first turn's cached KV, written by verify
    steps with drafts rejected past it: only verified tokens were cached. First turns end at every
    token of the answer (a stop id), so some end on the token after a rejected draft, whose own
    position holds that draft's KV until a later step writes it."""
    p = SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True)
    plain_engine = make_engine("qwen3", **BASE)
    answers = plain_engine.generate(PROMPTS, p)
    firsts, params = [], []
    for prompt, answer in zip(PROMPTS, answers):
        for token in _stop_candidates(answer.output_ids)[1:]:
            firsts.append(prompt)
            params.append(SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True, stop_token_ids=(token,)))
    first = plain_engine.generate(firsts, params)
    turns = [prompt + c.output_ids + [7, 8, 9] for prompt, c in zip(firsts, first)]
    second = plain_engine.generate(turns, p)
    # (dozens of requests at once: every step speculates, overlapped)
    engine = make_engine("qwen3", speculative="ngram", speculative_max_batch=0, **BASE)
    engine.scheduler.speculation.proposer = Oracle(PROMPTS + turns, answers + second)
    assert [c.output_ids for c in engine.generate(firsts, params)] == [c.output_ids for c in first]
    hits = engine.scheduler.stats["cache_hit_tokens"]
    spec_second = engine.generate(turns, p)
    assert [c.output_ids for c in spec_second] == [c.output_ids for c in second]
    assert sum(c.cached_tokens > len(prompt) for c, prompt in zip(spec_second, firsts)) > len(firsts) // 2
    assert engine.scheduler.stats["cache_hit_tokens"] > hits
    assert_speculated(engine)


def _stop_candidates(answer: list[int]) -> list[int]:
    """Each token of the answer at its first occurrence (a stop there ends the request at that token)."""
    return list(dict.fromkeys(answer))


def test_requests_finishing_inside_their_accepted_drafts_return_the_plain_tokens(make_engine):
    """A stop id, a stop string or max_tokens at every position of the answer: exactly the plain run's
    tokens, text and finish reason, also where the finishing token is followed by accepted drafts."""
    base = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)
    plain_engine = make_engine("llama", **BASE)
    [answer] = plain_engine.generate(PROMPTS[:1], base)
    prompts, params = [], []
    for token in _stop_candidates(answer.output_ids):
        prompts.append(PROMPTS[0])
        params.append(SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True, stop_token_ids=(token,)))
    text = answer.text
    for start in range(0, len(text) - 2, 2):
        prompts.append(PROMPTS[0])
        params.append(
            SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True, stop=(text[start : start + 3],))
        )
    for n in range(1, 25):
        prompts.append(PROMPTS[0])
        params.append(SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True))
    plain = plain_engine.generate(prompts, params)
    # (~70 requests at once: no batch limit, or the policy would run them plain)
    engine = make_engine("llama", speculative="ngram", speculative_max_batch=0, **BASE)
    engine.scheduler.speculation.proposer = Oracle(PROMPTS[:1], [answer])
    checked = watch(engine)
    spec = engine.generate(prompts, params)
    for a, b in zip(spec, plain):
        assert (a.output_ids, a.text, a.finish_reason, a.matched_stop) == (
            b.output_ids,
            b.text,
            b.finish_reason,
            b.matched_stop,
        )
    assert {c.finish_reason for c in spec} == {FinishReason.STOP, FinishReason.LENGTH}
    assert checked["mid_draft_finishes"] > 0
    assert_speculated(engine)


def test_eos_inside_the_accepted_drafts(make_engine, tiny_models, tmp_path):
    """A tiny model whose EOS is a token its greedy answer reaches inside a step's accepted drafts."""
    base = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)
    [answer] = make_engine("llama", **BASE).generate(PROMPTS[:1], base)
    probe = make_engine("llama", speculative="ngram", **BASE)
    probe.scheduler.speculation.proposer = Oracle(PROMPTS[:1], [answer])
    eos = None
    for token in _stop_candidates(answer.output_ids)[2:]:  # (not the first tokens: no drafts before them)
        checked = watch(probe)
        probe.generate(PROMPTS[:1], SamplingParams(max_new_tokens=24, temperature=0, stop_token_ids=(token,)))
        if checked["mid_draft_finishes"]:
            eos = token
            break
    assert eos is not None, "no token of the answer ends it inside accepted drafts"
    path = tmp_path / "eos-model"
    shutil.copytree(tiny_models("llama"), path)
    config = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps(config | {"eos_token_id": [eos]}))
    p = SamplingParams(max_new_tokens=24, temperature=0)
    plain_engine = Engine(model_path=str(path), device="cpu", max_total_tokens=16384, **BASE)
    [plain] = plain_engine.generate(PROMPTS[:1], p)
    assert plain.finish_reason is FinishReason.STOP and plain.matched_stop == eos and plain.output_ids[-1] == eos
    engine = Engine(model_path=str(path), device="cpu", max_total_tokens=16384, speculative="ngram", **BASE)
    engine.scheduler.speculation.proposer = Oracle(PROMPTS[:1], [answer])
    checked = watch(engine)
    [spec] = engine.generate(PROMPTS[:1], p)
    assert (spec.output_ids, spec.finish_reason, spec.matched_stop) == (plain.output_ids, plain.finish_reason, eos)
    assert checked["mid_draft_finishes"] == 1
    assert engine.is_idle() and plain_engine.is_idle()


def test_an_abort_while_a_verify_step_runs_frees_everything(make_engine):
    """Overlap loop: a request aborted while its verify step is in flight is answered at once; its
    result is dropped on arrival, the others keep the plain tokens, and the KV goes back to idle."""
    p = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)
    plain = make_engine("qwen3", **BASE).generate(PROMPTS, p)
    engine = make_engine("qwen3", speculative="ngram", **BASE)
    engine.scheduler.speculation.proposer = Oracle(PROMPTS, plain)
    rids = [engine.add_request(prompt, p) for prompt in PROMPTS]
    loop, done, victim = engine.event_loop(), {}, None
    while victim is None and engine.busy():
        for c in next(loop):
            done[c.rid] = c
        launched = engine.in_flight.last_batch()
        if launched is not None and launched.drafts is not None and any(launched.drafts):
            victim = launched.reqs[[bool(d) for d in launched.drafts].index(True)]
    assert victim is not None, "no verify step with drafts was ever in flight"
    aborted = engine.abort(victim.rid)
    assert aborted.finish_reason is FinishReason.ABORT and victim.discard == 1
    while engine.busy():
        for c in next(loop):
            done[c.rid] = c
    assert victim.rid not in done and victim.discard == 0
    for rid, expected in zip(rids, plain):
        if rid != victim.rid:
            assert done[rid].output_ids == expected.output_ids
    assert engine.is_idle() and engine.stats()["kv_used_tokens"] == 0
    assert_speculated(engine)


@pytest.mark.parametrize("overlap", [True, False])
def test_retraction_under_kv_pressure_keeps_the_tokens_and_frees_everything(make_engine, overlap):
    p = SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True)
    tight = dict(
        BASE,
        max_total_tokens=160,
        context_length=96,
        num_reserved_decode_tokens=4,
        disable_overlap_schedule=not overlap,
    )
    plain = make_engine("gpt2", **BASE).generate(PROMPTS, p)
    engine = make_engine("gpt2", speculative="ngram", **tight)
    engine.scheduler.speculation.proposer = Oracle(PROMPTS, plain)
    watch(engine)
    assert [c.output_ids for c in engine.generate(PROMPTS, p)] == [c.output_ids for c in plain]
    assert engine.scheduler.stats["retractions"] > 0
    assert engine.is_idle() and engine.stats()["kv_used_tokens"] == 0
    assert_speculated(engine)


@pytest.mark.parametrize("overlap", [True, False])
def test_the_disaggregated_decode_server_speculates_on_transferred_kv(tiny_models, overlap):
    """KV written by a prefill server (NIXL, DRAM), the first token from it: greedy n-gram speculation
    on the decode server gives transformers' tokens (the prefill server, given the same flags, ignores them)."""
    path = tiny_models("qwen3")
    expected = hf_greedy(path, PROMPTS, 24)
    spec = dict(speculative="ngram", speculative_overlap="on")
    prefill, decode = engines(path, overlap=overlap, decode_kw=spec, prefill_kw=spec)
    # Oracle drafts (the expected answers, one in three wrong): accepted and rejected, overlapped verify steps
    # whose positions move on the decode server (overlap on).
    answers = [SimpleNamespace(output_ids=e) for e in expected]
    decode.scheduler.speculation.proposer = Oracle(PROMPTS, answers)
    checked = watch(decode)
    params = [SamplingParams(max_new_tokens=24, temperature=0)] * len(PROMPTS)
    completions, _ = drive(prefill, decode, PROMPTS, params)
    assert [completions[f"r{i}"].output_ids for i in range(len(PROMPTS))] == expected
    assert_speculated(decode)
    assert (checked["moved"] > 0) == overlap
    assert decode.load().speculation == {"ngram": spec_stats(decode)}  # (the server's metrics: its load reports)
    assert prefill.load().speculation == {}
    assert prefill.is_idle() and decode.is_idle()
    prefill.close()
    decode.close()


def test_grammar_requests_are_not_speculated_and_share_the_verify_step(make_engine):
    """Speculation is off for structured outputs: a grammar request is a one-position row of the
    verify steps of the others (its mask row), with the plain engine's tokens."""
    schema = ("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}}))
    params = [SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)] * len(PROMPTS)
    params += [SamplingParams(max_new_tokens=40, temperature=0, grammar=schema)]
    prompts = PROMPTS + [[0, 5, 6, 7]]
    plain = make_engine("llama", **BASE).generate(prompts, params)
    engine = make_engine("llama", speculative="ngram", **BASE)
    engine.scheduler.speculation.proposer = Oracle(prompts, plain)
    with_grammar = []
    original = engine.scheduler.speculation.verify_batch

    def verify_batch(reqs, ends, writes):
        batch = original(reqs, ends, writes)
        if batch is not None:
            with_grammar.extend(d for r, d in zip(batch.reqs, batch.drafts) if r.grammar is not None)
        return batch

    engine.scheduler.speculation.verify_batch = verify_batch
    spec = engine.generate(prompts, params)
    assert [c.output_ids for c in spec] == [c.output_ids for c in plain]
    assert with_grammar and not any(with_grammar)  # in verify steps, never with drafts
    json.loads(spec[-1].text)
    assert_speculated(engine)


@pytest.mark.parametrize(
    "flags, message",
    [
        (dict(speculative="eagle"), "not yet built"),
        (dict(speculative="medusa"), "must be ngram"),
        (dict(speculative="ngram", num_speculative_tokens=0), "--num-speculative-tokens"),
        (dict(speculative="ngram", speculative_ngram_min=3, speculative_ngram_max=2), "--speculative-ngram-min"),
    ],
)
def test_speculative_set_ups_not_built_are_refused(tiny_models, flags, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model_path=tiny_models("llama"), device="cpu", **flags).resolve()


def test_the_triton_kernels_run_the_verify_step(make_engine):
    """The GPU path's attention (Triton's extend kernel over a request's last token and drafts; in
    Triton's interpreter on CPU): the plain engine's tokens, overlapped verify steps included."""
    p = SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True)
    triton = dict(BASE, attention_backend="triton", max_total_tokens=4096)
    plain = make_engine("llama", **triton).generate(PROMPTS[:2], p)
    engine = make_engine("llama", speculative="ngram", **triton)
    engine.scheduler.speculation.proposer = Oracle(PROMPTS[:2], plain)
    checked = watch(engine)
    assert [c.output_ids for c in engine.generate(PROMPTS[:2], p)] == [c.output_ids for c in plain]
    assert_speculated(engine)
    # Overlapped verify steps whose positions, KV slots and lengths moved on the device (the kernel reads
    # the device's lengths: the host's are the unmoved ones)
    assert checked["moved"] > 0 and not engine.runner.attn.host_lens
