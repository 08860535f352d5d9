"""Grammar-constrained sampling in the engine (common/engine/grammar.py): masks on the device, the
matcher one step behind in the overlap loop, the same tokens overlapped and serial, and the edges
(min_tokens, ignore_eos, logprobs, a bad grammar). Through the servers: test_structured_outputs.py."""

import json

import numpy as np
import pytest
import torch

from pdserve.common.engine.grammar import allowed_tokens, apply_bitmask, bitmask_words, grammar_source
from pdserve.common.openai.structured import choice_ebnf
from pdserve.common.types import FinishReason, SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 5},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
}
JSON = ("json_schema", json.dumps(SCHEMA))


class _Row:
    """What Grammars reads of a request."""

    def __init__(self, grammar):
        self.grammar, self.output_ids, self.pending, self.discard, self.finished = grammar, [], 0, 0, False
        self.params, self.rid = SamplingParams(max_new_tokens=100), "row"


def _batch(n: int, **kw) -> list[SamplingParams]:
    kw.setdefault("max_new_tokens", 120)
    return [SamplingParams(temperature=0.0 if i % 2 == 0 else 1.0, seed=i, grammar=JSON, **kw) for i in range(n)]


@pytest.fixture(scope="module")
def one_engine(tiny_models):
    """One llama engine for the tests that only generate through it or read its grammars: each
    engine's first grammar request spawns its grammar worker (~2.5 s of CPU). The tests that count
    compilations, patch the engine, read its trace or grow its masks make their own (make_engine)."""
    from pdserve.common.engine.engine import Engine

    return Engine(model_path=tiny_models("llama"), device="cpu", max_total_tokens=16384)


@pytest.fixture
def engine(one_engine):
    """The shared engine, idle (all KV rows and pages free) after every test, as make_engine's are."""
    assert one_engine.is_idle(), f"KV leaked before the test: {one_engine.stats()}"
    yield one_engine
    assert one_engine.is_idle(), f"KV leaked: {one_engine.stats()}"


def test_outputs_validate_and_overlap_equals_serial(make_engine):
    import jsonschema  # (a test dependency; tests/gpu imports this module on machines without it)

    prompts = [[5, 6, 7], [9] * 20, [11, 12], [40, 41, 42, 43]]
    outs = {}
    for overlap in (True, False):
        engine = make_engine("llama", disable_overlap_schedule=not overlap)
        outs[overlap] = engine.generate(prompts, _batch(4))
    assert [c.output_ids for c in outs[True]] == [c.output_ids for c in outs[False]]
    for c in outs[True]:
        assert c.finish_reason is FinishReason.STOP
        jsonschema.validate(json.loads(c.text), SCHEMA)


def test_overlap_keeps_launching_before_processing(make_engine):
    """The grammar batches stay overlapped: batch N is launched before N-1 is processed (its
    sampling waits for N-1's tokens; the forward does not)."""
    engine = make_engine("llama")
    engine.generate([[5, 6, 7], [8, 9]], _batch(2))
    trace = list(engine.trace)
    launches = [seq for kind, seq in trace if kind == "launch"]
    assert len(launches) > 10
    overlapped = sum(trace.index(("launch", n + 1)) < trace.index(("process", n)) for n in launches[:-1])
    assert overlapped >= len(launches) - 3, trace


def test_the_mask_allows_exactly_what_the_matcher_allows(engine):
    vocab = engine.vocab_size
    rows = [_Row(None), _Row(engine.grammars.matcher(("ebnf", choice_ebnf(["ab", "cd"]))))]
    bitmask = engine.grammars.bitmask(rows, [True, True], launched=False).result().clone()
    assert bitmask.shape == (2, bitmask_words(vocab))
    allowed = allowed_tokens(bitmask.numpy(), 1, vocab)
    assert allowed and len(allowed) < vocab
    assert allowed_tokens(bitmask.numpy(), 0, vocab) == list(range(vocab))  # the untouched row
    for token in allowed:
        assert engine.tokenizer.decode([token]) in ("a", "ab", "c", "cd"), token
    logits = torch.randn(2, vocab)
    masked = apply_bitmask(logits, bitmask)
    assert torch.equal(masked[0], logits[0])
    assert torch.isfinite(masked[1]).nonzero().flatten().tolist() == allowed


def test_strings_hold_no_raw_control_characters(engine):
    """xgrammar lets a string with maxLength hold raw control characters, which JSON forbids; the
    grammar is rewritten so that it cannot (json.loads refused such outputs)."""
    control = [t for t in range(engine.vocab_size) if engine.tokenizer.decode([t]) in ("\x12", "\x01", "\t")]
    assert control
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(engine.grammars.compile(JSON).result())  # (the grammar, as the worker compiles it)
    assert matcher.accept_string('{"name": "a')
    bitmask = torch.full((1, bitmask_words(engine.vocab_size)), -1, dtype=torch.int32)
    matcher.fill_next_token_bitmask(bitmask, 0)
    assert not set(control) & set(allowed_tokens(bitmask.numpy(), 0, engine.vocab_size))


def test_grammar_wins_over_min_tokens_and_ends_with_ignore_eos(engine):
    choice = ("ebnf", choice_ebnf(["yes", "no"]))
    outs = engine.generate(
        [[5, 6], [7, 8], [9, 10]],
        [
            SamplingParams(max_new_tokens=20, temperature=0, grammar=choice, min_new_tokens=10),
            SamplingParams(max_new_tokens=20, temperature=0, grammar=choice, ignore_eos=True),
            SamplingParams(max_new_tokens=20, temperature=0, grammar=choice, logprobs=2),
        ],
    )
    for c in outs:
        assert c.text in ("yes", "no") and c.finish_reason is FinishReason.STOP
        assert c.output_ids[-1] in engine.eos_token_ids and c.matched_stop == c.output_ids[-1]
    # Logprobs stay those of the raw distribution: the grammar's tokens need not be the model's top.
    raw = engine.generate([[9, 10]], [SamplingParams(max_new_tokens=1, temperature=0, logprobs=2)])[0]
    got, want = outs[2].logprobs[0].top, raw.logprobs[0].top
    assert [t for t, _ in got] == [t for t, _ in want]
    assert np.allclose([lp for _, lp in got], [lp for _, lp in want], atol=1e-5)


def test_a_bad_grammar_is_refused_before_anything_is_queued(engine):
    with pytest.raises(ValueError, match="cannot be compiled"):
        engine.add_request([1, 2, 3], SamplingParams(grammar=("json_schema", '{"type": "nonsense"}')))
    with pytest.raises(ValueError, match="cannot be compiled"):
        engine.generate([[1, 2]], [SamplingParams(grammar=("regex", "(unclosed"))])
    assert engine.is_idle()


def test_requests_without_grammar_are_unchanged_beside_grammar_ones(engine):
    plain = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    alone = engine.generate([[3, 4, 5]], [plain])[0].output_ids
    mixed = engine.generate([[3, 4, 5], [6, 7], [8, 9, 10]], [plain, *_batch(2)])
    assert mixed[0].output_ids == alone


def test_aborted_grammar_requests_free_their_kv(engine):
    rids = [engine.add_request([5, 6, 7], p) for p in _batch(3)]
    loop = engine.event_loop()
    for _ in range(4):
        next(loop)
    for rid in rids:
        engine.abort(rid)
    while engine.busy():
        next(loop)
    assert engine.is_idle()


def test_allowed_tokens_reads_bit_31():
    words = np.zeros((1, 2), dtype=np.int32)
    words[0, 0] = np.int32(-(2**31))  # bit 31: token 31
    words[0, 1] = 1  # token 32
    assert allowed_tokens(words, 0, 40) == [31, 32]


def test_grammars_compile_once_off_the_loop_and_a_failed_compile_fails_only_its_request(make_engine, monkeypatch):
    engine = make_engine("llama")
    grammars = engine.grammars
    assert grammars.compile(JSON) is grammars.compile(JSON), "one compilation per spec"
    good = ("ebnf", choice_ebnf(["yes", "no"]))
    bad = ("ebnf", choice_ebnf(["never", "compiled"]))
    compile_grammar, refused = grammars._compiler.compile_grammar, str(grammar_source(grammars._xgr, *bad))

    def compile_or_fail(source):  # `bad` parses, and fails on the compiling thread
        if str(source) == refused:
            raise ValueError("the ebnf grammar cannot be compiled: out of memory (a test)")
        return compile_grammar(source)

    monkeypatch.setattr(grammars._compiler, "compile_grammar", compile_or_fail)
    outs = engine.generate(
        [[5, 6], [7, 8]],
        [
            SamplingParams(max_new_tokens=10, temperature=0, grammar=bad),
            SamplingParams(max_new_tokens=10, temperature=0, grammar=good),
        ],
    )
    assert outs[0].finish_reason is FinishReason.ABORT and "out of memory (a test)" in outs[0].error
    assert outs[1].text in ("yes", "no") and outs[1].finish_reason is FinishReason.STOP
    assert engine.is_idle()


def test_masks_and_accepts_in_shares_equal_one_thread(make_engine):
    """A large batch's rows are accepted and filled in shares on several of the grammar worker's
    threads (this box may have too few cores to choose that itself): the same masks and the same
    acceptances as one thread, step after step, for rows in different states of different
    grammars. As in the overlap loop, each step's tokens are counted ahead and accepted in the
    worker with the next masks (accept_and_fill), a refused token failing its row."""
    from pdserve.common.engine.grammar import Grammars
    from pdserve.common.engine.grammar_worker import PARALLEL_ROWS

    engine = make_engine("llama")
    one = Grammars(engine.tokenizer, engine.vocab_size, engine.eos_token_ids, threads=1)
    three = Grammars(engine.tokenizer, engine.vocab_size, engine.eos_token_ids, threads=3)
    specs = [JSON, ("json_object", ""), ("regex", "[a-z]{2,9}@[a-z]{3}\\.com")]
    n = PARALLEL_ROWS + 5

    rows = {g: [_Row(g.matcher(specs[i % 3])) for i in range(n)] for g in (one, three)}
    samples = [i != 4 for i in range(n)]  # one row is not sampling this batch
    rng = np.random.default_rng(0)
    masks = {g: g.bitmask(rows[g], samples, launched=False).result().numpy() for g in (one, three)}
    for step in range(40):
        np.testing.assert_array_equal(masks[one], masks[three])
        tokens = []
        for i in range(n):
            allowed = allowed_tokens(masks[one], i, engine.vocab_size)
            tokens.append(int(rng.choice(allowed)))
        if step == 5:
            tokens[7] = next(
                t for t in range(engine.vocab_size) if t not in allowed_tokens(masks[one], 7, engine.vocab_size)
            )
        for g in (one, three):
            for row in rows[g]:
                row.pending = 2  # these tokens, and the next batch's, in flight (launched=True)
            masks[g] = g.accept_and_fill(rows[g], samples, tokens, rows[g], samples).result().numpy()
            for row, sampling, token in zip(rows[g], samples, tokens):
                row.pending = 0
                if sampling and not row.finished:  # (as output_processor.append_token)
                    row.output_ids.append(token)
                    row.finished = not row.grammar.accept(token, len(row.output_ids) - 1) or row.grammar.terminated
            assert not rows[g][7].grammar.terminated or step >= 5  # (a refused stop token counts as the end)
        assert [r.grammar.accepted for r in rows[one]] == [r.grammar.accepted for r in rows[three]]
        assert [r.grammar.refused for r in rows[one]] == [r.grammar.refused for r in rows[three]]
    assert rows[three][7].grammar.refused is not None and rows[three][8].grammar.refused is None
    assert rows[three][7].finished and not rows[three][7].grammar.accept(tokens[7], 99)
    assert rows[three][4].grammar.accepted == 0
    assert any(r.grammar.terminated for r in rows[three]), "no grammar completed: the test did not reach an end"


def test_a_token_the_grammar_refuses_fails_its_request_and_frees_it(make_engine, monkeypatch, caplog):
    """The masks keep every sampled token inside the grammar; were one ever outside (a bug), its
    request fails with an error that names the token, the others go on, nothing leaks. Masks
    switched off here, overlap on and off."""
    from pdserve.common.engine import sampling

    monkeypatch.setattr(sampling, "apply_bitmask", lambda logits, bitmask: logits)
    for overlap in (True, False):
        engine = make_engine("llama", disable_overlap_schedule=not overlap)
        params = [
            SamplingParams(max_new_tokens=30, temperature=0, grammar=("regex", "[0-9]{20,40}")),
            SamplingParams(max_new_tokens=30, temperature=0),
        ]
        outs = engine.generate([[5, 6, 7], [8, 9]], params)
        assert outs[0].finish_reason is FinishReason.ABORT, (overlap, outs[0])
        assert "outside the request's grammar" in outs[0].error
        assert outs[1].finish_reason is FinishReason.LENGTH and len(outs[1].output_ids) == 30
        assert engine.is_idle() and engine.scheduler.kv_used_tokens() == 0
        # The worker's matcher refused it (logged when the step's masks were taken), one token
        # before the request failed.
        assert "a grammar refused token" in caplog.text
        caplog.clear()


def test_the_worker_grows_its_shared_masks_for_a_large_batch(make_engine):
    """The masks go through shared memory sized for START_ROWS rows a slot; a larger batch grows
    it (the worker is told), and the rows stay right across the slots after it."""
    from pdserve.common.engine.grammar_worker import BUFFERS, START_ROWS

    engine = make_engine("llama")
    choice = ("ebnf", choice_ebnf(["ab", "cd"]))
    n = START_ROWS + 44
    for size in (8, n, 8, n, *[8] * BUFFERS):
        rows = [_Row(engine.grammars.matcher(choice)) for _ in range(size)] + [_Row(None)]
        mask = engine.grammars.bitmask(rows, [True] * len(rows), launched=False).result().numpy()
        assert mask.shape == (size + 1, bitmask_words(engine.vocab_size))
        assert (mask[-1] == -1).all() and not (mask[0] == -1).all()
        assert (mask[:-1] == mask[0]).all()
    assert engine.grammars._worker.capacity >= n


def test_a_dead_grammar_worker_stops_the_engine_with_a_clear_error(tiny_models):
    """As a dead TP rank does: the engine raises (its server exits), naming the worker."""
    from pdserve.common.engine.engine import Engine

    engine = Engine(model_path=tiny_models("llama"), device="cpu", max_total_tokens=16384)  # (left broken)
    choice = ("ebnf", choice_ebnf(["yes", "no"]))
    out = engine.generate([[5, 6]], [SamplingParams(max_new_tokens=5, temperature=0, grammar=choice)])[0]
    assert out.text in ("yes", "no")
    worker = engine.grammars._worker
    worker.process.kill()
    worker.process.wait()
    with pytest.raises(RuntimeError, match="grammar worker"):
        engine.generate([[7, 8]], [SamplingParams(max_new_tokens=5, temperature=0, grammar=choice)])


def test_a_request_dropped_with_a_token_queued_is_forgotten_by_the_worker(make_engine):
    """A token accepted outside a step (a decode server's first) goes with the next step; if its
    request is gone by then (freed in that same message) the worker skips it."""
    import gc

    engine = make_engine("llama")
    grammars = engine.grammars
    choice = ("ebnf", choice_ebnf(["ab", "cd"]))
    row = _Row(grammars.matcher(choice))
    first = grammars.bitmask([row], [True], launched=False).result()
    token = allowed_tokens(first.numpy(), 0, engine.vocab_size)[0]
    grammar = row.grammar
    queued = grammar.accept(token, 0)  # (not inside an assert: pytest would keep a reference)
    assert queued and grammar.accepted == 1  # queued for the next step
    dropped = grammar.id
    del row, grammar
    gc.collect()
    assert dropped in grammars._freed and any(i == dropped for i, _ in grammars._queued)
    other = _Row(grammars.matcher(choice))
    mask = grammars.bitmask([other], [True], launched=False).result()
    assert np.array_equal(mask.numpy(), first.numpy())
    assert other.grammar.refused is None and not grammars._freed and not grammars._queued


@pytest.mark.parametrize(
    "grammar",
    [
        ("json_schema", json.dumps({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})),
        ("json_schema", json.dumps({"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]})),
    ],
)
def test_numbers_end_even_when_the_model_wants_digits_forever(engine, grammar):
    """A model that would write digits forever (here: every digit token biased by +100) still ends
    its number and its object: integer parts of at most 20 digits, fractions of 20, exponents of 3
    (common/engine/grammar_source.py). Without the bound it writes digits until max_tokens."""
    digits = [t for t in range(engine.vocab_size) if engine.tokenizer.decode([t]) in list("0123456789.")]
    [out] = engine.generate(
        [[5, 6]],
        [
            SamplingParams(
                max_new_tokens=200, temperature=0, grammar=grammar, logit_bias=tuple((t, 100.0) for t in digits)
            )
        ],
    )
    assert out.finish_reason is FinishReason.STOP, out.text
    value = json.loads(out.text)
    number = next(iter(value.values())) if isinstance(value, dict) else value
    mantissa, _, exponent = out.text.strip("{}[] ").split(":")[-1].strip().lower().partition("e")
    whole, _, fraction = mantissa.lstrip("-").partition(".")
    assert isinstance(number, (int, float)) and len(exponent.lstrip("+-")) <= 3, out.text
    assert len(whole) <= 20 and len(fraction) <= 20, out.text
    if "integer" in grammar[1]:
        assert len(whole) == 20, out.text  # as many as the bound lets the biased model write
    else:  # "." is biased too: the digits run to one of the bounds
        assert 20 in (len(whole), len(fraction)), out.text


def test_json_object_numbers_are_bounded_too(engine):
    """json_object's grammar (xgrammar's builtin JSON) gets the same bounds: a 21st digit of an
    integer part, a 21st of a fraction and a 4th of an exponent are refused."""
    import xgrammar as xgr

    compiled = engine.grammars.compile(("json_object", "")).result()
    for text, longest in (("[" + "9" * 20, "9"), ("[1." + "5" * 20, "5"), ("[1e+" + "2" * 3, "2")):
        matcher = xgr.GrammarMatcher(compiled)
        assert matcher.accept_string(text), text
        assert not matcher.accept_string(longest), text
        assert matcher.accept_string("]"), text


def test_a_top_p_below_float32s_range_keeps_the_top_token(engine):
    """top_p = 1e-72 (a valid request) is 0 in float32: it must still keep the top token (it dropped
    every token, and token 0 was sampled against the grammar). It samples as greedy does."""
    grammar = ("json_object", "")
    tiny, greedy = engine.generate(
        [[5, 6], [5, 6]],
        [
            SamplingParams(max_new_tokens=3, temperature=2.0, top_p=1e-72, seed=1, grammar=grammar),
            SamplingParams(max_new_tokens=3, temperature=0, grammar=grammar),
        ],
    )
    assert tiny.error is None and tiny.output_ids == greedy.output_ids


def test_grammars_made_at_start_up_outlive_the_thread_that_made_them(make_engine):
    """A server's start-up (GrammarsAtStart) makes the Grammars on a thread of its own and compiles
    WARMUP_GRAMMAR on both sides. NOTE the grammar worker dies with the thread that spawned it
    (PR_SET_PDEATHSIG): spawned on that short-lived thread, it was killed as the thread ended."""
    import threading

    from pdserve.common.engine.grammar import WARMUP_GRAMMAR
    from pdserve.common.engine.grammar_startup import GrammarsAtStart

    engine = make_engine("llama")  # (the offline engine: its own are made on first use, not here)
    start = GrammarsAtStart(engine.config, engine.tokenizer, engine.eos_token_ids, None, warm=True)
    assert start.wait()
    for thread in threading.enumerate():
        if thread.name == "grammar-startup":
            thread.join(timeout=10)
    grammars = start.get()
    assert grammars._compiled[WARMUP_GRAMMAR][0].done()
    choice = ("ebnf", choice_ebnf(["ab", "cd"]))
    mask = grammars.bitmask([_Row(grammars.matcher(choice))], [True], launched=False).result()
    assert grammars._worker.process.poll() is None, "the grammar worker died with the start-up's thread"
    allowed = {engine.tokenizer.decode([t]) for t in allowed_tokens(mask.numpy(), 0, engine.vocab_size)}
    assert allowed and all("ab".startswith(a) or "cd".startswith(a) for a in allowed), allowed
    assert not GrammarsAtStart(engine.config, engine.tokenizer, engine.eos_token_ids, None, warm=False).wait()


def test_a_repeated_spec_compiles_once_on_both_sides(make_engine, monkeypatch):
    """The second request with a spec compiles nothing: the server's compiler ran once, and the grammar
    worker was sent the spec once (it compiles what it is sent; its matchers share that compilation)."""
    engine = make_engine("llama")
    grammars = engine.grammars
    compiled, sent = [], []
    compile_grammar, add_grammar = grammars._compiler.compile_grammar, grammars._worker.add_grammar
    monkeypatch.setattr(grammars._compiler, "compile_grammar", lambda s: compiled.append(s) or compile_grammar(s))
    monkeypatch.setattr(grammars._worker, "add_grammar", lambda k, g: sent.append(g) or add_grammar(k, g))
    params = SamplingParams(max_new_tokens=30, temperature=0, grammar=JSON)
    first = engine.generate([[5, 6]], [params])[0]
    second = engine.generate([[5, 6]], [params])[0]
    assert second.output_ids == first.output_ids
    assert len(compiled) == 1 and sent == [JSON]
