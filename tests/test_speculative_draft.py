"""The draft-model proposer (--speculative draft, common/engine/speculative/draft.py): every token is the
plain engine's (and transformers'), greedy and seeded, overlap on and off, with the target itself as the
draft model (every draft accepted) and with another model of the same vocabulary (drafts accepted and
rejected); the draft pool rolled back after every verify step and back to idle after aborts and
retraction; every draft forward of one token per request a DECODE forward (the CUDA-graph path on a GPU);
the disaggregated decode server; the flags' refusals.
"""

import contextlib
import functools
import shutil
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.common.config import EngineConfig
from pdserve.common.engine.cuda_graph import CudaGraphRunner
from pdserve.common.engine.speculative.draft import DraftProposer
from pdserve.common.scheduling.batch import ForwardMode
from pdserve.common.scheduling.pages import pages_for
from pdserve.common.tiny_model import make_tiny_model
from pdserve.common.types import FinishReason, Req, SamplingParams
from tests.test_disagg_engines import drive, engines, hf_greedy
from tests.test_speculative_engine import BASE, PROMPTS, assert_speculated, spec_stats, watch


@pytest.fixture(scope="module")
def other_draft(tiny_models, tmp_path_factory):
    """arch -> a draft model with the target's vocabulary and other weights: the target's, each tensor
    moved by 5% of its spread (about half its drafts are accepted)."""
    built = {}

    def get(arch: str) -> str:
        if arch not in built:
            path = tmp_path_factory.mktemp(f"draft-{arch}")
            shutil.copytree(tiny_models(arch), path, dirs_exist_ok=True)
            weights, noise = load_file(path / "model.safetensors"), torch.Generator().manual_seed(1)
            moved = {
                name: w + 0.05 * w.std() * torch.randn(w.shape, generator=noise) if w.numel() > 1 else w
                for name, w in weights.items()
            }
            save_file(moved, path / "model.safetensors")
            built[arch] = str(path)
        return built[arch]

    return get


def watch_drafts(engine) -> dict:
    """After every verify step: each running request's draft KV is for tokens that agree with its own (the
    rejected drafts' rolled back; what a proposal for a step in flight assumed past them kept) on exactly
    the pages those tokens need, and the draft pool's pages are the requests' or free. Also records the
    tokens of each extend draft forward (at most the chunk size), their lengths per request, and each
    decode draft forward's batch size and whether its input ids were on the device (a feed-back of the
    last forward's argmax) or the host's (a catch-up)."""
    spec, proposer = engine.scheduler.speculation, engine.proposer
    assert isinstance(proposer, DraftProposer)
    seen = {"forward_tokens": [], "extend_lens": [], "decodes": [], "checked": 0}
    original, greedy, decode = spec.process_result, proposer.runner.greedy, proposer.runner.decode

    def process_result(batch, next_ids, logprobs, accepted):
        done = original(batch, next_ids, logprobs, accepted)
        for req in batch.reqs:
            state = proposer.states.get(req.rid)
            if state is None or req.finished:
                continue
            tokens = req.prompt_ids + req.output_ids
            common = min(len(state.tokens), len(tokens))  # (past the tokens: the drafts of a step in flight)
            assert state.tokens[:common] == tokens[:common], req.rid
            assert len(state.pages) == pages_for(len(state.tokens), engine.config.page_size)
            seen["checked"] += 1
        held = sum(len(s.pages) for s in proposer.states.values())
        assert held + proposer.runner.kv_pool.num_free_pages() == proposer.runner.kv_pool.capacity_pages
        return done

    def counted(input_ids, rows, starts, lens, slots):
        seen["forward_tokens"].append(sum(lens))
        seen["extend_lens"].append(list(lens))
        return greedy(input_ids, rows, starts, lens, slots)

    def counted_decode(input_ids, rows, positions, slots):
        seen["decodes"].append((len(rows), isinstance(input_ids, torch.Tensor)))
        return decode(input_ids, rows, positions, slots)

    spec.process_result = process_result
    proposer.runner.greedy = counted
    proposer.runner.decode = counted_decode
    return seen


def acceptance(engine) -> float:
    """Accepted drafts over the drafts judged (those dropped unjudged, `spec_unconfirmed_tokens`, left out)."""
    stats = spec_stats(engine)
    return stats["spec_accepted_tokens"] / (stats["spec_proposed_tokens"] - stats["spec_unconfirmed_tokens"])


@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen3"])  # (qwen3's requests end at EOS: steps dropped)
def test_greedy_equals_the_plain_engine_and_transformers(make_engine, tiny_models, other_draft, arch):
    """The target as its own draft model (all drafts accepted) and another model (some rejected), overlap
    on and off: transformers' tokens. Prompts past 16 tokens reach the draft model in chunks of 16."""
    p = SamplingParams(max_new_tokens=24, temperature=0)
    expected = hf_greedy(tiny_models(arch), PROMPTS, 24)
    assert [c.output_ids for c in make_engine(arch, **BASE).generate(PROMPTS, p)] == expected
    for draft in (tiny_models(arch), other_draft(arch)):
        for overlap in (True, False):
            engine = make_engine(
                arch, speculative="draft", draft_model_path=draft, disable_overlap_schedule=not overlap, **BASE
            )
            checked, drafts = watch(engine), watch_drafts(engine)
            assert [c.output_ids for c in engine.generate(PROMPTS, p)] == expected, (draft, overlap)
            assert_speculated(engine)
            assert checked["verify_steps"] == spec_stats(engine)["spec_verify_steps"]
            assert drafts["checked"] > 0 and max(drafts["forward_tokens"]) == BASE["chunked_prefill_size"]
            stats = spec_stats(engine)
            # Overlap on: verify steps proposed while the one before ran (--speculative-overlap on)
            assert (stats["spec_overlapped_steps"] > 0) == overlap, stats
            if draft == tiny_models(arch):  # (every guess holds: the draft is the target)
                assert acceptance(engine) > 0.95, stats
                assert stats["spec_unconfirmed_tokens"] == checked["dropped_drafts"], (stats, checked)
            else:
                assert 0.1 < acceptance(engine) < 0.9, stats
            assert engine.proposer.is_idle()


@pytest.mark.parametrize("draft", ["other", "target"])
@pytest.mark.parametrize("overlap", [True, False])
def test_one_token_draft_forwards_take_the_decode_path(make_engine, tiny_models, other_draft, overlap, draft):
    """The k - 1 feed-back forwards of every proposal, and each catch-up where every request has one or two
    unseen tokens (two after a step that accepted every draft: the draft target itself), are DECODE
    forwards (runner.decode: the draft's CUDA graphs on a GPU, eager on CPU), two for a catch-up of two;
    extend forwards remain for catch-ups where a request has more (its prompt, in chunks). Same tokens as
    transformers."""
    p = SamplingParams(max_new_tokens=24, temperature=0)
    expected = hf_greedy(tiny_models("llama"), PROMPTS, 24)
    engine = make_engine(
        "llama",
        speculative="draft",
        draft_model_path=other_draft("llama") if draft == "other" else tiny_models("llama"),
        disable_overlap_schedule=not overlap,
        **BASE,
    )
    seen, proposer, per_proposal = watch_drafts(engine), engine.proposer, []
    propose_batch = proposer.propose_batch

    def counted(reqs, limits, extras=None, guesses=None):
        before = len(seen["decodes"])
        drafts = propose_batch(reqs, limits, extras, guesses)
        feedbacks = sum(on_device for _, on_device in seen["decodes"][before:])
        per_proposal.append((max(map(len, drafts), default=0), feedbacks, len(seen["decodes"]) - before - feedbacks))
        return drafts

    proposer.propose_batch = counted
    modes, init_forward = [], proposer.runner.attn.init_forward

    def init_counted(batch):
        modes.append(batch.mode)
        return init_forward(batch)

    proposer.runner.attn.init_forward = init_counted
    decodes = proposer.runner.decode_forwards
    assert [c.output_ids for c in engine.generate(PROMPTS, p)] == expected
    assert_speculated(engine)
    assert proposer.runner.graphs is None and proposer.runner.graph_replays == 0  # (CPU: eager decode forwards)
    assert proposer.runner.decode_forwards - decodes == len(seen["decodes"]) == modes.count(ForwardMode.DECODE)
    assert modes.count(ForwardMode.EXTEND) == len(seen["extend_lens"])
    # k - 1 feed-backs (none without drafts), k in the overlapped loop with overlap on (the last draft's too: its
    # guess asked for), at most two catch-ups
    for k, feedbacks, catch_ups in per_proposal:
        assert feedbacks == (k if overlap else max(k - 1, 0)) and catch_ups <= 2, per_proposal
    for before, lens in zip([[0]] + seen["extend_lens"], seen["extend_lens"]):  # (one token: a chunked catch-up's tail)
        assert max(lens) > 1 or sum(before) == BASE["chunked_prefill_size"], seen["extend_lens"]
    catch_ups = [bs for bs, on_device in seen["decodes"] if not on_device]
    if not (overlap and draft == "target"):  # (there every proposal but the first starts from `next`)
        assert catch_ups and max(catch_ups) > 1, seen["decodes"]  # (batched over the step's requests)
    assert max(bs for bs, on_device in seen["decodes"] if on_device) > 1
    if draft == "other":
        assert 0.1 < acceptance(engine) < 0.9
    elif overlap:  # every draft accepted and every guess held: most proposals start from the last one's `next`
        assert acceptance(engine) > 0.95 and sum(c == 0 for _, _, c in per_proposal) >= len(per_proposal) // 2
    else:  # every draft accepted: the catch-ups after the first proposal are two DECODE forwards
        assert acceptance(engine) > 0.95 and sum(c == 2 for _, _, c in per_proposal) >= len(per_proposal) // 2
    assert engine.proposer.is_idle()


def test_seeded_sampling_gives_the_plain_engines_tokens(make_engine, other_draft):
    """Greedy drafts, verified exactly at any temperature: the plain engine's tokens, seed for seed."""
    plain_engine = make_engine("gpt2", **BASE)
    engine = make_engine("gpt2", speculative="draft", draft_model_path=other_draft("gpt2"), **BASE)
    watch_drafts(engine)
    for params in (
        dict(temperature=0.8, top_p=0.9, seed=7),
        dict(temperature=0.6, top_k=20, seed=11, presence_penalty=1.0),
    ):
        p = SamplingParams(max_new_tokens=24, ignore_eos=True, **params)
        plain = plain_engine.generate(PROMPTS, p)
        assert [c.output_ids for c in engine.generate(PROMPTS, p)] == [c.output_ids for c in plain]
    assert_speculated(engine)


def test_an_abort_while_a_verify_step_runs_frees_both_pools(make_engine, other_draft):
    p = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)
    plain = make_engine("qwen3", **BASE).generate(PROMPTS, p)
    engine = make_engine("qwen3", speculative="draft", draft_model_path=other_draft("qwen3"), **BASE)
    watch_drafts(engine)
    rids = [engine.add_request(prompt, p) for prompt in PROMPTS]
    loop, done, victim = engine.event_loop(), {}, None
    while victim is None and engine.busy():
        for c in next(loop):
            done[c.rid] = c
        launched = engine.in_flight.last_batch()
        if launched is not None and launched.drafts is not None and any(launched.drafts):
            victim = launched.reqs[[bool(d) for d in launched.drafts].index(True)]
    assert victim is not None, "no verify step with drafts was ever in flight"
    assert victim.rid in engine.proposer.states
    assert engine.abort(victim.rid).finish_reason is FinishReason.ABORT
    assert victim.rid not in engine.proposer.states  # (its draft pages freed with it)
    while engine.busy():
        for c in next(loop):
            done[c.rid] = c
    for rid, expected in zip(rids, plain):
        if rid != victim.rid:
            assert done[rid].output_ids == expected.output_ids
    assert engine.proposer.is_idle() and engine.is_idle()
    assert_speculated(engine)


@pytest.mark.parametrize("overlap", [True, False])
def test_retraction_under_kv_pressure_frees_both_pools(make_engine, other_draft, overlap):
    p = SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True)
    tight = dict(BASE, max_total_tokens=160, context_length=96, num_reserved_decode_tokens=4)
    plain = make_engine("gpt2", **BASE).generate(PROMPTS, p)
    engine = make_engine(
        "gpt2",
        speculative="draft",
        draft_model_path=other_draft("gpt2"),
        disable_overlap_schedule=not overlap,
        **tight,
    )
    retracted = []
    retract = engine.scheduler._retract

    def retract_and_check(victim):
        had_drafts = victim.rid in engine.proposer.states
        retract(victim)
        assert victim.rid not in engine.proposer.states  # its draft pages went with its target pages
        retracted.append(had_drafts)

    engine.scheduler._retract = engine.scheduler.decode.retract = retract_and_check
    watch(engine)
    watch_drafts(engine)
    assert [c.output_ids for c in engine.generate(PROMPTS, p)] == [c.output_ids for c in plain]
    assert engine.scheduler.stats["retractions"] == len(retracted) and any(retracted), retracted
    assert engine.proposer.is_idle() and engine.is_idle()
    assert_speculated(engine)


def test_the_disaggregated_decode_server_drafts_on_transferred_kv(tiny_models, other_draft):
    """The decode server builds the draft model's KV of prompts whose target KV a prefill server wrote."""
    path = tiny_models("qwen3")
    expected = hf_greedy(path, PROMPTS, 24)
    spec = dict(speculative="draft", draft_model_path=other_draft("qwen3"))
    prefill, decode = engines(path, decode_kw=spec, prefill_kw=spec)
    params = [SamplingParams(max_new_tokens=24, temperature=0)] * len(PROMPTS)
    completions, _ = drive(prefill, decode, PROMPTS, params)
    assert [completions[f"r{i}"].output_ids for i in range(len(PROMPTS))] == expected
    assert_speculated(decode)
    assert decode.load().speculation == {"draft": spec_stats(decode)}
    assert prefill.proposer is None
    assert decode.proposer.is_idle() and prefill.is_idle() and decode.is_idle()
    prefill.close()
    decode.close()


def test_draft_set_ups_not_built_are_refused(tiny_models, tmp_path):
    llama = tiny_models("llama")
    other_vocab = str(make_tiny_model(tmp_path / "vocab", "llama", overrides={"vocab_size": 640}))
    refused = [
        (dict(speculative="draft"), "needs --draft-model-path"),
        (
            dict(speculative="draft", draft_model_path=str(tmp_path / "missing")),
            "--draft-model-path .* has no config.json",
        ),
        (dict(speculative="draft", draft_model_path=other_vocab), "vocabulary of 640 tokens"),
        (dict(speculative="ngram", draft_model_path=llama), "is for --speculative draft"),
    ]
    for flags, message in refused:
        with pytest.raises(ValueError, match=message):
            EngineConfig(model_path=llama, device="cpu", **flags).resolve()


def test_the_draft_pool_holds_the_drafts_kv_then_the_accepted_prefix(tiny_models):
    """Exact bookkeeping: the target as its own draft model drafts its greedy continuation; the draft KV
    then covers the prompt and drafts 1 .. k-1 (pages of 4 tokens); after a step that accepted 2 of the 4,
    the prompt and those 2; a new request under the same rid starts afresh; release gives all back."""
    path = tiny_models("llama")
    config = EngineConfig(
        model_path=path, device="cpu", speculative="draft", draft_model_path=path, page_size=4, chunked_prefill_size=16
    ).resolve()
    proposer = DraftProposer(config, torch.device("cpu"), target_pages=64)
    # rows for a verify step's requests (--speculative-max-batch), pages for them at full context or the target's
    assert proposer.runner.req_to_token_pool.size == config.speculative_max_batch == 8
    assert proposer.runner.kv_pool.capacity_pages == 64
    prompt = PROMPTS[3]  # 46 tokens: three catch-up forwards of at most 16
    [greedy] = hf_greedy(path, [prompt], 8)
    req = Req("a", prompt, SamplingParams(max_new_tokens=8, temperature=0), seed=0)
    short = Req("b", PROMPTS[2], SamplingParams(max_new_tokens=8, temperature=0), seed=0)
    drafts = proposer.propose_batch([req, short], [4, 2], guesses=[True, False])
    assert drafts == [greedy[:4], hf_greedy(path, [PROMPTS[2]], 2)[0]]
    state = proposer.states["a"]
    # Every draft fed back, the last one too (its guess asked for), not the other's
    assert state.next == greedy[4] == proposer.guess_after(req, greedy[:4])
    assert proposer.states["b"].next is None and len(proposer.states["b"].tokens) == len(PROMPTS[2]) + 1
    assert state.tokens == prompt + greedy[:4] and len(state.pages) == pages_for(len(prompt) + 4, 4)
    assert state.settled == len(prompt)  # (only the drafts are compared after the step)
    # The next step proposed while this one runs: after its drafts, the first a guess of its bonus token,
    # from `next` (no catch-up forward: 3 feed-backs, the last giving `next` again)
    forwards = proposer.runner.decode_forwards
    assert proposer.propose_batch([req], [3], [greedy[:4]], [True]) == [greedy[4:7]]
    assert proposer.runner.decode_forwards - forwards == 3 and state.next == greedy[7]
    assert state.tokens == prompt + greedy[:7] and state.settled == len(prompt)
    req.output_ids = greedy[:5]  # the first step kept all 4 and sampled the guessed token: nothing is cut
    proposer.rollback(req)
    assert state.tokens == prompt + greedy[:7] and state.next == greedy[7] and state.settled == len(prompt) + 5
    req.output_ids = greedy[:2] + [7]  # (the other history: 2 drafts accepted, then a token of the target's own)
    state.settled = len(prompt)
    proposer.rollback(req)
    assert state.tokens == prompt + greedy[:2] and len(state.pages) == pages_for(len(prompt) + 2, 4) == 12
    assert state.next is None and proposer.guess_after(req, greedy[2:4]) is None
    again = Req("a", prompt, SamplingParams(max_new_tokens=8, temperature=0), seed=0)
    assert proposer.propose_for(again, 1) == greedy[:1]  # (no guess asked: no draft fed back)
    assert proposer.states["a"].req is again and proposer.states["a"].tokens == prompt
    free = proposer.runner.kv_pool.num_free_pages()
    proposer.release(again)
    proposer.release(req)  # (no longer the rid's owner: nothing to free)
    assert proposer.runner.kv_pool.num_free_pages() == free + pages_for(len(prompt), 4)
    proposer.retain([])
    assert proposer.is_idle()
    proposer.warmup()  # (what a GPU runs at start-up)
    assert proposer.is_idle()


def test_the_draft_graph_path_gives_the_greedy_drafts(tiny_models, monkeypatch):
    """The draft model's CUDA-graph path on CPU (Triton's interpreter), each graph stood in for by a run of
    what it captured: the adapter's pieces, `packed` built on the device, batches padded to the captured
    sizes (1, 2, 4). Every DECODE forward is a replay; the drafts are transformers' greedy tokens."""
    path = tiny_models("llama")
    expected = hf_greedy(path, PROMPTS[:3], 5)  # (before the torch.cuda stubs: transformers reads its Stream)
    monkeypatch.setattr(CudaGraphRunner, "_capture_all", stand_in_capture)
    stub = SimpleNamespace(wait_stream=lambda other: None)
    for name, value in dict(Stream=lambda device: stub, current_stream=lambda device: stub).items():
        monkeypatch.setattr(torch.cuda, name, value)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: (0, 0))
    config = EngineConfig(
        model_path=path, device="cpu", speculative="draft", draft_model_path=path, attention_backend="triton", **BASE
    ).resolve()
    proposer = DraftProposer(config, torch.device("cpu"), target_pages=64)
    runner = proposer.runner
    assert runner.graphs is None  # (not on CPU: captured here by hand)
    runner.graphs = runner._capture(4)
    assert runner.graphs.sizes == [1, 2, 4]
    reqs = [Req(f"r{i}", p, SamplingParams(max_new_tokens=8, temperature=0), seed=0) for i, p in enumerate(PROMPTS[:3])]
    # The prompts' catch-up (extend), then 4 feed-backs of 3 requests (padded to 4; the last draft's too)
    assert proposer.propose_batch(reqs, [4, 4, 4], guesses=[True] * 3) == [tokens[:4] for tokens in expected]
    assert runner.graphs.replays == runner.decode_forwards == 4
    for req, tokens in zip(reqs, expected):
        req.output_ids = tokens[:2]  # as if a step kept draft 1 and gave draft 2 as its own: one unseen token
    # The catch-up of one host token each (3, padded to 4), then feed-backs of 3 requests, 2 and 1
    drafts = proposer.propose_batch(reqs, [2, 3, 1], guesses=[True] * 3)
    assert drafts == [expected[0][2:4], expected[1][2:5], expected[2][2:3]]
    assert runner.graphs.replays == runner.decode_forwards == 8
    for req in reqs:
        proposer.release(req)
    assert proposer.is_idle()


@torch.inference_mode()
def stand_in_capture(graphs: CudaGraphRunner) -> None:
    """CudaGraphRunner._capture_all on CPU: each size's "graph" runs the captured forward again into the
    captured output (its static inputs, its padding, its binding of the attention backend)."""
    for bs in reversed(graphs.sizes):
        run = functools.partial(graphs._run_model, bs)
        graphs.logits[bs] = out = run()
        graphs.graphs[bs] = SimpleNamespace(replay=functools.partial(lambda out, run: out.copy_(run()), out, run))


def test_the_triton_kernels_run_the_draft_model(make_engine, other_draft):
    """The GPU path's attention for the draft model's forwards too (Triton's extend kernel; in Triton's
    interpreter on CPU): the plain engine's tokens."""
    p = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    triton = dict(BASE, attention_backend="triton", max_total_tokens=4096)
    plain = make_engine("qwen3", **triton).generate(PROMPTS[2:3], p)
    engine = make_engine("qwen3", speculative="draft", draft_model_path=other_draft("qwen3"), **triton)
    watch_drafts(engine)
    assert [c.output_ids for c in engine.generate(PROMPTS[2:3], p)] == [c.output_ids for c in plain]
    assert_speculated(engine)
