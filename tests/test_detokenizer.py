"""Incremental detokenization against a real byte-level BPE, and stop-string search."""

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from pdserve.common.detokenizer import IncrementalDetokenizer, find_stop_string

CORPUS = [
    "The quick brown fox jumps over the lazy dog. Hello world, hello there!",
    "Café crème brûlée, naïve façade, señor Müller, smörgåsbord, Ærø.",
    "東京は日本の首都です。中文字符测试，汉字很多。한국어 문장도 있어요.",
    "Emoji time 😀🎉🚀 👩‍💻 and more 🙂 text! Flags 🇫🇷 too.",
    "Ünïcödé ñ ç ø å ß œ æ — “quotes” … ok",
]
TEXTS = CORPUS + ["hello café 東京 😀!", "  spaced   out  ", "no-merge: 🦄 ☃ 龍 ẞ", "a\nb\tc"]


@pytest.fixture(scope="module")
def tokenizer():
    """A byte-level BPE with ~300 tokens: most multi-byte characters span several tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", clean_up_tokenization_spaces=False
    )


def _run(tokenizer, prompt, output, skip):
    """Feeds `output` token by token; checks every emission is a clean full decode so far."""
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip)
    pieces = []
    for i, token in enumerate(output):
        piece = detok.add(token)
        pieces.append(piece)
        if piece:
            # What was emitted is the decode of a whole prefix of the output, ending on a complete
            # character: nothing was split.
            assert detok.text == tokenizer.decode(output[: i + 1], skip_special_tokens=skip)
            assert not piece.endswith("\ufffd")
    pieces.append(detok.flush())
    assert "".join(pieces) == detok.text == tokenizer.decode(output, skip_special_tokens=skip)
    return pieces


def test_the_tokenizer_really_splits_characters(tokenizer):
    ids = tokenizer.encode("東京 😀", add_special_tokens=False)
    assert any(tokenizer.decode([i]).endswith("\ufffd") for i in ids)


@pytest.mark.parametrize("skip", [True, False])
def test_valid_text_streams_without_broken_characters(tokenizer, skip):
    prompt = tokenizer.encode("Prompt: ", add_special_tokens=False)
    for text in TEXTS:
        output = tokenizer.encode(text, add_special_tokens=False)
        pieces = _run(tokenizer, prompt, output, skip)
        assert "".join(pieces) == text
        assert not any("\ufffd" in p for p in pieces)
    # Special tokens inside the output are dropped or kept as the full decode does.
    output = tokenizer.encode("東京", add_special_tokens=False) + [1] + tokenizer.encode("😀", add_special_tokens=False)
    _run(tokenizer, prompt, output, skip)


@pytest.mark.parametrize("skip", [True, False])
def test_random_token_sequences_match_a_full_decode(tokenizer, skip):
    rng = random.Random(1234)
    vocab = len(tokenizer)
    byte_tokens = [i for i in range(vocab) if tokenizer.decode([i]) == "\ufffd"]
    for _ in range(300):
        # Prompts may end mid-character; outputs mix random tokens, lone bytes (often invalid UTF-8),
        # special tokens and stretches of real text.
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, 8))]
        output = []
        while len(output) < 30:
            kind = rng.random()
            if kind < 0.4:
                output.append(rng.choice(byte_tokens))
            elif kind < 0.5:
                output.append(rng.choice([0, 1]))
            elif kind < 0.8:
                output.append(rng.randrange(vocab))
            else:
                output += tokenizer.encode(rng.choice(TEXTS)[: rng.randrange(1, 12)], add_special_tokens=False)
        _run(tokenizer, prompt, output, skip)


def test_prompt_ending_inside_a_character_does_not_leak_into_the_output(tokenizer):
    ids = tokenizer.encode("東", add_special_tokens=False)
    assert len(ids) > 1
    prompt, output = ids[:1], ids[1:]
    assert _run(tokenizer, prompt, output, True)[-1] == tokenizer.decode(output)  # all held until flush


def test_flush_is_empty_when_nothing_is_held(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [5], skip_special_tokens=True)
    for token in tokenizer.encode("hello", add_special_tokens=False):
        detok.add(token)
    assert detok.text == "hello" and detok.flush() == ""


# ---- find_stop_string ----------------------------------------------------------------------------


def test_stop_string_inside_the_new_text():
    assert find_stop_string("hello world", 5, ("wor",)) == (6, "wor")


def test_stop_string_spanning_old_and_new_text():
    # old "hello wo", new "rld": the stop starts in the old text and ends in the new one
    assert find_stop_string("hello world", 3, ("o wor",)) == (4, "o wor")


def test_earliest_stop_wins_and_ties_go_to_the_first_listed():
    assert find_stop_string("abcdefgh", 8, ("fg", "cd", "e")) == (2, "cd")
    assert find_stop_string("abcdefgh", 8, ("cde", "cd")) == (2, "cde")
    assert find_stop_string("abcdefgh", 8, ("cd", "cde")) == (2, "cd")


def test_no_match_entirely_in_the_old_text():
    # "ab" occurs only in the old text: it was looked for when that text arrived.
    assert find_stop_string("ab--xyz", 3, ("ab",)) is None
    assert find_stop_string("ab--xyz", 3, ("ab", "xy")) == (4, "xy")
    # a long stop widens the window for itself, not for the short one
    assert find_stop_string("xx12345", 1, ("x", "12345")) == (2, "12345")
    assert find_stop_string("x12345", 1, ("x",)) is None


def test_nothing_new_or_no_stops():
    assert find_stop_string("hello", 0, ("he",)) is None
    assert find_stop_string("hello", 5, ()) is None
    assert find_stop_string("hi", 10, ("hi",)) == (0, "hi")  # new_text_len past the start is clamped


@pytest.mark.parametrize("clean_up", [False, True])
def test_fast_decoder_equals_tokenizer_decode(tokenizer, clean_up):
    """The backend shortcut gives tokenizer.decode's text exactly (and is skipped with clean-up on)."""
    from pdserve.common.detokenizer import fast_decoder

    tok = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer.backend_tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        clean_up_tokenization_spaces=clean_up,
    )
    decode = fast_decoder(tok)
    rng = random.Random(3)
    for text in TEXTS:
        ids = tok.encode(text) + [tok.eos_token_id]
        for cut in (len(ids), rng.randrange(1, len(ids))):
            for skip in (False, True):
                assert decode(ids[:cut], skip) == tok.decode(ids[:cut], skip_special_tokens=skip)


@pytest.mark.parametrize("clean_up", [False, True])
@pytest.mark.parametrize("batched", [False, True])
def test_flush_all_equals_flush_one_at_a_time(tokenizer, clean_up, batched, monkeypatch):
    """Finishing a batch (one batched decode, or one decode per window for a few) leaves every
    detokenizer as its own flush() would: fresh ones (the context's window), ones that emitted
    already, mixed skip flags."""
    from pdserve.common import detokenizer
    from pdserve.common.detokenizer import flush_all

    calls = []
    real = detokenizer.fast_batch_decoder
    monkeypatch.setattr(detokenizer, "fast_batch_decoder", lambda t: calls.append(1) or real(t))
    if batched:
        monkeypatch.setattr(detokenizer, "BATCH_DECODE_MIN_WINDOWS", 1)

    tok = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer.backend_tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        clean_up_tokenization_spaces=clean_up,
    )
    vocab = len(tok)

    def build(seed_rng):
        batch = []
        for i in range(12):
            prompt = [seed_rng.randrange(vocab) for _ in range(seed_rng.randrange(0, 8))]
            d = IncrementalDetokenizer(tok, prompt, skip_special_tokens=bool(i % 2))
            for _ in range(seed_rng.randrange(0, 6)) if i % 3 else ():
                d.add(seed_rng.randrange(vocab))  # some emitted text already
            d.tokens += [seed_rng.randrange(vocab) for _ in range(seed_rng.randrange(0, 10))]
            batch.append(d)
        return batch

    one, together = build(random.Random(7)), build(random.Random(7))
    expected = [d.flush() for d in one]
    assert flush_all(together) == expected
    assert [d.text for d in together] == [d.text for d in one]
    assert bool(calls) == batched  # 12 sequences are under the batch threshold
