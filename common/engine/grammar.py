"""Structured output: grammars compiled with xgrammar, one matcher per request, token bitmasks.

    grammars = Grammars(tokenizer, vocab_size, eos_token_ids)    # one per engine (TP rank 0)
    req.grammar = grammars.matcher(params.grammar)               # ValueError: the library refused it
    mask = grammars.bitmask(reqs, samples, launched).result()   # host int32 [B, ceil(V / 32)]
    masks = grammars.accept_and_fill(reqs, samples, tokens, next_reqs, next_samples)  # overlap loop
    logits = apply_bitmask(logits, device_mask)                  # on the device, in sample()

Why xgrammar (docs/architecture.md): on this engine's tokenizers it fills a request's mask in ~3 us
(median; llguidance ~25 us) and SGLang and vLLM use it by default; it compiles a JSON schema in
~6 ms (llguidance ~2.5 ms), which the cache pays once per schema. The mask is a bit per vocabulary
id (the model's vocabulary, padding ids included: they are never allowed).

The matcher accepts every token the request keeps (common/scheduling/output_processor.append_token;
in the overlap loop ahead of it, on the worker thread: Grammars.accept_and_fill), the first one included: on a decode server that is the prefill server's token, sampled there under
the same grammar. When the grammar is complete the mask allows only the model's EOS; accepting it
terminates the matcher and finishes the request (even with ignore_eos: nothing else could follow).
"""

from __future__ import annotations

import logging
import os
import re
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

# How many compiled grammars a server keeps (by kind and text), least recently used out first.
CACHE_ENTRIES = 512
# Threads that accept a batch's tokens and fill its masks (at most the cores this process may use,
# less two), from this many grammar rows on. Each takes every k-th row (the costly states spread
# out) through its own one-thread BatchGrammarMatcher (xgrammar's own max_threads > 1 was slower
# than one thread), two xgrammar calls a step. Every call gives the GIL up and takes it back from
# the loop's thread, so threads pay only with few calls each: four (Llama-1B shape, batch 128 on
# an H200, docs/benchmarks.md: the bounded-strings schema 2.5-2.8x the plain step with four,
# 2.9-3.4x with two, 4.3x with one; the usual schema 1.10-1.19x with two or four, 1.29x with one).
FILL_THREADS = 4
PARALLEL_ROWS = 16
MAX_ERROR_CHARS = 400
# xgrammar's messages start with "[03:59:31] /project/cpp/regex_converter.cc:83: " and may hold
# "Check failed: (...) is false: ": noise for the client.
_LOCATION = re.compile(r"\[[\d:]+\] \S+:\d+: |Check failed: \(.*?\) is false: ")

logger = logging.getLogger(__name__)


class Grammars:
    """Compiles SamplingParams.grammar specs for one tokenizer and caches them by their text."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...], threads: int | None = None,
                 pin_memory: bool = False):
        import xgrammar as xgr  # imports torch and its kernels: only servers and engines load it
        from xgrammar.matcher import _core

        self._xgr = xgr
        self._accept_batch = _core.BatchGrammarMatcher.batch_accept_token  # (see _work)
        self.vocab_size = vocab_size
        self.pin_memory = pin_memory  # masks in page-locked memory: copied to the device as they are
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=list(eos_token_ids))
        self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)  # ours is below
        self._compiled: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._compile_pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        if threads is None:
            threads = min(FILL_THREADS, len(os.sched_getaffinity(0)) - 2)  # leave the loop and the frontend theirs
        self.threads = max(1, threads)
        # One C++ call per share of rows (no Python loop), one matcher object per thread.
        self._batch = [xgr.BatchGrammarMatcher(max_threads=1) for _ in range(self.threads)]
        self._shares = ThreadPoolExecutor(self.threads - 1, thread_name_prefix="grammar-rows") if self.threads > 1 else None
        self._filler = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")

    def check(self, grammar: tuple[str, str]) -> None:
        """ValueError, with the library's reason, for a grammar it refuses. Fast (the grammar is
        only parsed); compiling it against the vocabulary is `matcher`'s, off this thread."""
        if grammar not in self._compiled:
            self._source(grammar)

    def _source(self, grammar: tuple[str, str]):
        """(kind, spec) parsed into an xgrammar Grammar (or its EBNF text); ValueError if refused."""
        kind, spec = grammar
        xgr = self._xgr
        try:
            if kind == "json_object":
                return xgr.Grammar.builtin_json_grammar()
            if kind == "json_schema":
                # Compact JSON (no free whitespace): a weak or random model could otherwise emit
                # whitespace until max_tokens and never close the object. strict_mode: no
                # properties or items beyond the schema's, as OpenAI's strict mode.
                return _no_raw_control_characters(xgr.Grammar.from_json_schema(spec, any_whitespace=False, strict_mode=True))
            if kind == "regex":
                return xgr.Grammar.from_regex(spec)
            if kind == "ebnf":
                return xgr.Grammar.from_ebnf(spec)
            if kind == "structural_tag":
                return _no_raw_control_characters(xgr.Grammar.from_structural_tag(spec))
        except Exception as e:  # xgrammar raises RuntimeError, ValueError or its own InvalidJSONError
            reason = _LOCATION.sub("", " ".join(str(e).split()))[:MAX_ERROR_CHARS]
            raise ValueError(f"the {kind} grammar cannot be compiled: {reason}") from None
        raise ValueError(f"unknown grammar kind {kind!r}")

    def compile(self, grammar: tuple[str, str]) -> Future:
        """The CompiledGrammar of (kind, spec), as a Future: compiled once per spec (cached, the
        least recently used out past CACHE_ENTRIES) on a worker thread, since building the token
        masks of a 128k vocabulary takes up to ~1 s (docs/benchmarks.md) and the event loop must
        not stop for it. It raises ValueError if the library refuses the grammar."""
        future = self._compiled.get(grammar)
        if future is not None:
            self._compiled.move_to_end(grammar)
            return future
        source = self._source(grammar)
        future = self._compile_pool.submit(self._compiler.compile_grammar, source)
        self._compiled[grammar] = future
        if len(self._compiled) > CACHE_ENTRIES:
            self._compiled.popitem(last=False)
        return future

    def matcher(self, grammar: tuple[str, str]) -> "RequestGrammar":
        """A request's matcher; it is made when first used (by then its grammar is compiled: the
        compilation runs while the request queues and its prompt is computed)."""
        return RequestGrammar(self.compile(grammar), self._xgr.GrammarMatcher)

    def bitmask(self, reqs, samples: list[bool], launched: bool) -> Future:
        """The batch's allowed tokens as a host int32 bitmask [B, words] (bit j of word w: token
        32 w + j), or None when no row samples under a grammar, as a Future: the masks are filled
        on a worker thread (xgrammar releases the GIL), so the caller's Python work overlaps it.
        Rows without a grammar allow everything.

        Call when every grammar request's matcher has accepted all its tokens but the one this
        batch samples (`launched`: the batch's own token is already counted as pending). A row
        whose matcher is terminated, or refused a token, keeps an all-ones row: its request is
        finished or failed, and its token is dropped on arrival. The matchers must not advance
        until the Future is done.
        """
        return self._submit([], [], reqs, samples, launched)

    def accept_and_fill(self, reqs, samples: list[bool], token_ids: list[int], next_reqs, next_samples: list[bool]) -> Future:
        """Advance the matchers of a processed batch's grammar rows by their new tokens, then fill
        the masks of the batch launched after it (`next_reqs`, whose sampling waits for them), both
        on the worker thread; the Future's result is `bitmask`'s. Rows the scheduler will drop
        (not sampling, or results to discard) are left alone.

        The tokens are counted as accepted here, before the matchers see them, so the scheduler
        can process the batch at once (output_processor.append_token finds them accepted; a stop
        token terminates: the mask allowed one only where the grammar may end). A token a matcher
        refuses (a bug: the mask allows only what it accepts) is logged, and its request fails at
        its next token (RequestGrammar.accept).

        NOTE this takes acceptance off the loop's thread: 128 accepts cost ~0.3-0.6 ms of C++,
        as much as a Llama-1B decode step's spare host time (docs/benchmarks.md).
        """
        accepting, tokens = [], []
        for req, sampling, token in zip(reqs, samples, token_ids):
            grammar = req.grammar
            if grammar is None or not sampling or req.discard or req.finished or not grammar.usable() \
                    or req.params.max_new_tokens <= 0:
                continue
            grammar.accepted_one(token)
            accepting.append(grammar)
            tokens.append(token)
        return self._submit(accepting, tokens, next_reqs, next_samples, launched=True)

    def _submit(self, accepting: list, tokens: list[int], reqs, samples: list[bool], launched: bool) -> Future:
        """Accept `tokens` into the matchers of `accepting`, then fill the masks of the batch
        `reqs`, on the worker thread. The rows are dealt out in `threads` shares, every k-th row
        of the batch to a share (the costly states spread out), a request's token to the share
        that fills its row (the fill needs the token accepted).

        NOTE this runs on the loop's thread for every grammar step: explicit loops, a few
        attribute reads per row (128 rows: ~0.1 ms)."""
        k = self.threads if max(len(reqs), len(accepting)) >= PARALLEL_ROWS else 1
        shares = [_Share() for _ in range(k)]
        in_flight = 1 if launched else 0
        n = 0
        for i, (req, sampling) in enumerate(zip(reqs, samples)):
            grammar = req.grammar
            if grammar is None or not sampling or grammar.terminated or req.finished or not grammar.usable():
                continue
            # NOTE the matcher must have accepted exactly the tokens before the one this row
            # samples: the kept ones, and those in flight that will be kept (counted ahead by
            # accept_and_fill). A mask filled one token off would constrain the wrong position.
            assert grammar.accepted == len(req.output_ids) + req.pending - req.discard - in_flight, \
                (req.rid, grammar.accepted, len(req.output_ids), req.pending, req.discard, in_flight)
            grammar.share = n % k
            share = shares[grammar.share]
            share.filling.append(grammar)
            share.rows.append(i)
            n += 1
        for grammar, token in zip(accepting, tokens):
            share = shares[grammar.share if grammar.share < k else 0]  # (one not filled now: any share)
            share.accepting.append(grammar)
            share.tokens.append(token)
        shape = (len(reqs), bitmask_words(self.vocab_size))
        return self._filler.submit(self._job, shares, shape)

    def _job(self, shares: list["_Share"], shape: tuple[int, int]) -> torch.Tensor | None:
        """The worker thread's: every share accepted and filled, the first here, the others on
        the share threads. NOTE each xgrammar call releases the GIL and must take it back from
        the loop's thread, which holds it while it runs Python (CPython hands it over at most
        every switch interval, 5 ms, or when the holder waits): so few calls per share, and
        none per row."""
        bitmask = None
        if any(share.rows for share in shares):
            # (Made here, off the loop's thread: 2 MB for 128 rows of a 128k vocabulary. Pinned
            # blocks come from torch's caching host allocator, which keeps one until the copies
            # that read it have run.)
            bitmask = torch.empty(shape, dtype=torch.int32, pin_memory=self.pin_memory)
            if sum(len(share.rows) for share in shares) < shape[0]:
                bitmask.fill_(-1)  # xgrammar writes whole rows: only the others need it
        futures = [self._shares.submit(self._work, self._batch[j], share, bitmask) for j, share in enumerate(shares[1:], 1)]
        try:
            self._work(self._batch[0], shares[0], bitmask)
        finally:
            for future in futures:
                future.result()
        return bitmask

    def _work(self, batch, share: "_Share", bitmask: torch.Tensor | None) -> None:
        """One share: its tokens accepted, then its rows filled (two xgrammar calls)."""
        if share.accepting:
            # xgrammar's own batch_accept_token converts its result with two calls per row, each
            # giving the GIL up and waiting to take it back: the core function, then one test.
            accepted = self._accept_batch([g.matcher._handle for g in share.accepting], share.tokens, False)
            if 0 in accepted:  # (ints, 0 or 1: `False in` finds none) a bug: the masks allow only what the matchers accept
                for grammar, token, ok in zip(share.accepting, share.tokens, list(accepted)):
                    if not ok:
                        grammar.refused = token
                        logger.error("a grammar refused token %d: its request fails at its next token", token)
        if share.rows:
            batch.batch_fill_next_token_bitmask([g.matcher for g in share.filling], bitmask, share.rows)


class _Share:
    """A worker's part of a step: tokens to accept, then rows to fill."""

    __slots__ = ("accepting", "tokens", "filling", "rows")

    def __init__(self):
        self.accepting: list[RequestGrammar] = []
        self.tokens: list[int] = []
        self.filling: list[RequestGrammar] = []
        self.rows: list[int] = []


# xgrammar 0.2.8 writes a string with maxLength as `[^"\\\r\n]{0, n}`: raw control characters
# (U+0000-U+001F other than CR and LF) are allowed there, which JSON forbids (json.loads and
# JSON.parse refuse the output; its unbounded strings exclude them). The class is rewritten as
# its unbounded strings have it.
_LOOSE_STRING_CHARACTER = '[^\\"\\\\\\r\\n]'
_JSON_STRING_CHARACTER = '[^\\0-\\x1f\\"\\\\]'


def _no_raw_control_characters(grammar) -> str:
    """The grammar's EBNF with JSON's rule for string characters everywhere."""
    return str(grammar).replace(_LOOSE_STRING_CHARACTER, _JSON_STRING_CHARACTER)


class RequestGrammar:
    """One request's matcher: where its output is inside the grammar. Made from the compiled
    grammar when first needed (Grammars.matcher); a grammar whose compilation failed refuses
    every token (`failure` says why; the request then fails)."""

    __slots__ = ("_compiled", "_make", "_matcher", "_stops", "accepted", "refused", "failure", "terminated", "share")

    def __init__(self, compiled: Future, make_matcher):
        self._compiled, self._make, self._matcher = compiled, make_matcher, None
        # Tokens accepted: len(req.output_ids), or one more when the engine counted the newest
        # token ahead of the scheduler's processing (Grammars.accept_and_fill: the matcher
        # itself may still be accepting it on the worker thread).
        self.accepted = 0
        self.refused: int | None = None  # a token the grammar did not allow (a bug if ever set)
        self.failure: str | None = None
        # The grammar is complete and its stop token was accepted: xgrammar accepts a stop token
        # only where the grammar may end, and then terminates (the matcher's is_terminated(),
        # kept here since it is read per row and step and each call crosses into C++).
        self.terminated = False
        self._stops: frozenset[int] = frozenset()
        self.share = 0  # the worker share that last filled its row (Grammars._submit): it accepts its tokens

    @property
    def matcher(self):
        if self._matcher is None:
            self._matcher = self._make(self._compiled.result())  # waits only if still compiling
            self._stops = frozenset(self._matcher.stop_token_ids)
        return self._matcher

    def accepted_one(self, token: int) -> None:
        self.accepted += 1
        if token in self._stops:
            self.terminated = True

    def usable(self) -> bool:
        """Compiled (waiting for it if need be) and not failed."""
        if self.failure is None and self._matcher is None:
            try:
                self.matcher
            except ValueError as e:
                self.failure, self.refused = str(e), -1
        return self.failure is None and self.refused is None

    def accept(self, token: int, position: int) -> bool:
        """Advance by `token`, output token number `position` (0-based), unless that one was
        counted already (Grammars.accept_and_fill); False when the grammar does not allow it, or
        refused an earlier token (`refused` names it)."""
        if self.refused is not None:
            return False
        if self.accepted > position:
            return True
        if not self.usable() or not self.matcher.accept_token(token):
            self.refused = token
            return False
        self.accepted_one(token)
        return True

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


_BITS = {}


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """`logits` [B, V] (any float dtype) with the tokens `bitmask` [B, ceil(V / 32)] int32 (on the
    same device) does not allow set to -inf, as a new tensor. The grammar always allows a token
    (EOS once it is complete), so no row is left without one."""
    masked = logits.clone()
    if logits.is_cuda:
        # xgrammar's Triton kernel: one pass over the logits (the torch expression below writes
        # and reads an int32 per vocabulary id and row).
        from xgrammar.kernels.apply_token_bitmask_inplace_triton import apply_token_bitmask_inplace_triton

        apply_token_bitmask_inplace_triton(masked, bitmask)
        return masked
    batch, vocab = logits.shape
    bits = _BITS.get(logits.device)
    if bits is None:
        bits = _BITS[logits.device] = torch.arange(32, dtype=torch.int32, device=logits.device)
    # An arithmetic shift of a word with bit 31 set fills with ones; `& 1` keeps only bit j.
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).view(batch, -1)[:, :vocab]
    return masked.masked_fill_(allowed == 0, float("-inf"))


def allowed_tokens(bitmask: np.ndarray, row: int, vocab_size: int) -> list[int]:
    """The token ids a host bitmask row allows (for tests and debugging)."""
    words = np.asarray(bitmask[row], dtype=np.uint32)
    bits = (words[:, None] >> np.arange(32, dtype=np.uint32)) & 1
    return [int(t) for t in np.flatnonzero(bits.reshape(-1)[:vocab_size])]
