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
REPLACEMENT_CHAR = "\ufffd"


def fast_decoder(tokenizer):
    """`decode(ids, skip_special_tokens)` giving exactly `tokenizer.decode`'s text, cheaper.

    A fast tokenizer's decode is its Rust backend's decode plus an optional clean-up pass; the
    Python wrapper around it (argument conversion, per-id type checks) costs several times the
    decode itself. Where clean-up is off, call the backend directly; otherwise keep the wrapper.
    Resolved once per tokenizer and cached on it.
    """
    cached = getattr(tokenizer, "_pdserve_decode", None)
    if cached is not None:
        return cached
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is not None and hasattr(backend, "decode") and not getattr(tokenizer, "clean_up_tokenization_spaces", True):

        def decode(ids, skip_special_tokens):
            return backend.decode(ids, skip_special_tokens=skip_special_tokens)

    else:

        def decode(ids, skip_special_tokens):
            return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    try:
        tokenizer._pdserve_decode = decode
    except AttributeError:  # a tokenizer that refuses attributes: resolve again next time
        pass
    return decode


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

    def _emit(self, final: bool) -> str:
        if self.read_offset == self.context_len:  # nothing emitted yet: the window is the context
            prefix_text = self._context_text
        else:
            prefix_text = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.tokens[self.prefix_offset :])
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
