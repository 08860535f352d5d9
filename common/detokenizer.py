"""Incremental detokenization that never splits a UTF-8 character, and stop-string search.

`IncrementalDetokenizer` uses the prefix/read offset scheme of vLLM and TGI: it decodes a short
window of tokens twice, without and with the tokens not yet emitted, and emits the difference
once it no longer ends in U+FFFD (an incomplete character). The window starts a few tokens back,
seeded from the prompt, so a tokenizer that drops a leading space at the start of a decode
(SentencePiece) still spaces the first output word as a full decode would.
"""

from __future__ import annotations

# Prompt tokens kept as leading context (vLLM uses the same number).
PROMPT_CONTEXT_TOKENS = 5
# Fewer windows than this are decoded one by one. NOTE: the Rust backend's decode_batch hands a
# batch to its thread pool (a pool per process, a thread per core, spinning before it sleeps): for
# the one or two windows a router finishing one request decodes, that was 18 us against 1.5 us,
# 13% of a router worker's CPU on a burst of short requests, and the pool's spinning takes cores
# the other processes on the host need. At 64 windows the two cost the same on 2 cores.
BATCH_DECODE_MIN_WINDOWS = 128
REPLACEMENT_CHAR = "\ufffd"


def _rust_backend(tokenizer):
    """A fast tokenizer's Rust backend when calling it directly gives exactly `tokenizer.decode`.

    A fast tokenizer's decode is its backend's decode plus an optional clean-up pass; the Python
    wrapper around it (argument conversion, per-id type checks) costs several times the decode
    itself. With clean-up off the backend's text is the answer; otherwise None (use the wrapper).
    """
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or not hasattr(backend, "decode") or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return None
    return backend


def fast_decoder(tokenizer):
    """`decode(ids, skip_special_tokens)`: exactly `tokenizer.decode`'s text, cheaper."""
    backend = _rust_backend(tokenizer)
    if backend is not None:
        return lambda ids, skip: backend.decode(ids, skip_special_tokens=skip)
    return lambda ids, skip: tokenizer.decode(ids, skip_special_tokens=skip)


def fast_batch_decoder(tokenizer):
    """`decode_batch(list_of_ids, skip_special_tokens)`: each entry exactly `tokenizer.decode`'s
    (the Rust backend decodes a batch on several threads)."""
    backend = _rust_backend(tokenizer)
    if backend is not None and hasattr(backend, "decode_batch"):
        return lambda seqs, skip: backend.decode_batch(seqs, skip_special_tokens=skip)
    decode = fast_decoder(tokenizer)
    return lambda seqs, skip: [decode(ids, skip) for ids in seqs]


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.decode_fn = fast_decoder(tokenizer)
        self.skip_special_tokens = skip_special_tokens
        context = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])
        # A prompt that ends inside a character would glue its bytes to the output's first bytes;
        # with no context the output decodes exactly as it would alone.
        context_text = self._decode(context)
        if context_text.endswith(REPLACEMENT_CHAR):
            context, context_text = [], ""
        self.tokens = context  # the context, then every output token
        self.context_len = len(context)
        self.prefix_offset = 0  # start of the window decoded for context
        self.read_offset = len(context)  # tokens before this one have been emitted
        self.text = ""
        self._context_text = context_text  # the first window's prefix text, decoded already

    def _decode(self, ids: list[int]) -> str:
        return self.decode_fn(ids, self.skip_special_tokens)

    def _prefix_window(self) -> list[int] | None:
        """Tokens whose text is already emitted (None: nothing emitted yet, the context's text)."""
        return None if self.read_offset == self.context_len else self.tokens[self.prefix_offset : self.read_offset]

    def _emit(self, final: bool) -> str:
        window = self._prefix_window()
        prefix_text = self._context_text if window is None else self._decode(window)
        return self._advance(prefix_text, self._decode(self.tokens[self.prefix_offset :]), final)

    def _advance(self, prefix_text: str, new_text: str, final: bool) -> str:
        if len(new_text) <= len(prefix_text) or (not final and new_text.endswith(REPLACEMENT_CHAR)):
            return ""
        delta = new_text[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        self.text += delta
        return delta

    def add(self, token_id: int) -> str:
        """Appends one output token; returns the text that became final (may be "")."""
        self.tokens.append(token_id)
        return self._emit(final=False)

    def num_output(self) -> int:
        """Output tokens added so far."""
        return len(self.tokens) - self.context_len

    def emit_ready(self) -> str:
        """Text of the tokens added so far that is final (an incomplete character held back)."""
        return self._emit(final=False)

    def flush(self) -> str:
        """End of sequence: whatever was held back (U+FFFD where the bytes were truly invalid)."""
        return self._emit(final=True)


def flush_all(detokenizers: list[IncrementalDetokenizer]) -> list[str]:
    """flush() of each, with their decodes in one batch per tokenizer when there are many (a fast
    tokenizer decodes a batch on several threads): what finishing a whole batch at once costs."""
    out: list[str] = [""] * len(detokenizers)
    groups: dict[tuple[int, bool], list[int]] = {}
    for i, d in enumerate(detokenizers):
        groups.setdefault((id(d.tokenizer), d.skip_special_tokens), []).append(i)
    for (_, skip), members in groups.items():
        windows, slots = [], []  # slots[i]: (index of prefix window or None, index of new window)
        for i in members:
            d = detokenizers[i]
            prefix = d._prefix_window()
            prefix_at = None
            if prefix is not None:
                prefix_at = len(windows)
                windows.append(prefix)
            windows.append(d.tokens[d.prefix_offset :])
            slots.append((prefix_at, len(windows) - 1))
        if len(windows) >= BATCH_DECODE_MIN_WINDOWS:
            texts = fast_batch_decoder(detokenizers[members[0]].tokenizer)(windows, skip)
        else:
            decode = detokenizers[members[0]].decode_fn
            texts = [decode(ids, skip) for ids in windows]
        for i, (prefix_at, new_at) in zip(members, slots):
            d = detokenizers[i]
            prefix_text = d._context_text if prefix_at is None else texts[prefix_at]
            out[i] = d._advance(prefix_text, texts[new_at], final=True)
    return out


def find_stop_string(text: str, new_text_len: int, stops: tuple[str, ...]) -> tuple[int, str] | None:
    """The earliest stop string in `text` that overlaps its last `new_text_len` characters.

    Returns (index into text, stop), or None. Among stops found at the same index the first listed
    wins. Only the tail that could hold a new match is searched: a match that ends before the new
    text was already there (and looked for) when that text arrived.
    """
    if new_text_len <= 0:
        return None
    old_len = max(len(text) - new_text_len, 0)
    best: tuple[int, str] | None = None
    for stop in stops:
        index = text.find(stop, max(old_len - len(stop) + 1, 0))
        if index != -1 and (best is None or index < best[0]):
            best = (index, stop)
    return best
