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

The matchers live in the grammar worker, a process of their own (common/engine/grammar_worker.py:
beside the event loop's thread, xgrammar calls on threads of this process waited for the GIL and
slowed the loop). This module keeps each request's count of accepted tokens and whether it is
terminated, so the loop never waits to know them.

The matcher accepts every token the request keeps (output_processor.append_token, or ahead of it
in the overlap loop: Grammars.accept_and_fill), the first one included: on a decode server that is
the prefill server's token, sampled there under the same grammar. When the grammar is complete the
mask allows only the model's EOS; accepting it terminates the matcher and finishes the request
(even with ignore_eos: nothing else could follow).
"""

from __future__ import annotations

import itertools
import logging
import weakref
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from pdserve.common.engine.grammar_source import grammar_source
from pdserve.common.engine.grammar_worker import GrammarWorker, fill_threads

# How many compiled grammars a server keeps (by kind and text), least recently used out first.
CACHE_ENTRIES = 512
# What Grammars.warm_up compiles at start-up: a JSON schema, so the schema path (xgrammar's converter,
# grammar_source's rewrites) has run once too. It stays in the cache as any other spec.
WARMUP_GRAMMAR = ("json_schema", '{"type": "object", "properties": {"ok": {"type": "boolean"}}}')

logger = logging.getLogger(__name__)


class Grammars:
    """Compiles SamplingParams.grammar specs for one tokenizer and caches them by their text; the
    requests' matchers live in the grammar worker process (common/engine/grammar_worker.py)."""

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        threads: int | None = None,
        pin_memory: bool = False,
        fence=None,
        worker: GrammarWorker | None = None,
    ):
        """`threads`: the worker's fill threads (default: fill_threads()); `worker`: one spawned
        already (GrammarWorker(threads), not described yet), else it is spawned here."""
        import xgrammar as xgr  # imports torch and its kernels: only servers and engines load it

        self._xgr = xgr
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=list(eos_token_ids))
        # Compiled here too (the worker compiles its own copy): a spec that fails fails its
        # request before it is scheduled (RequestGrammar.usable).
        self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)  # ours is below
        self._compiled: OrderedDict[tuple[str, str], tuple[Future, int]] = OrderedDict()
        self._compile_pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        self._stops = frozenset(info.stop_token_ids)
        self._worker = worker or GrammarWorker(fill_threads() if threads is None else max(1, threads))
        self.threads = self._worker.threads
        weakref.finalize(self, self._worker.close)
        # `fence`: () -> an event after every mask copy queued so far (CUDA), so a shared-memory
        # slot is filled again only once the device has read it.
        self._worker.describe(info.serialize_json(), vocab_size, pin_memory, fence)
        self._keys = itertools.count(1)
        self._ids = itertools.count(1)
        self._by_id: weakref.WeakValueDictionary[int, RequestGrammar] = weakref.WeakValueDictionary()
        self._new: list[list[int]] = []  # [id, key]: matchers the worker makes with the next step
        self._freed: list[int] = []  # ids of dropped requests, whose matchers the worker drops
        self._queued: list[list[int]] = []  # [id, token] accepted outside a step (RequestGrammar.accept)
        self._replayed: set[int] = set()  # ids whose replayed tokens (RequestGrammar.replay) the next step sends

    def warm_up(self) -> None:
        """Compile WARMUP_GRAMMAR here and in the worker, and wait until the worker has made a
        matcher of it (then dropped it): the worker's start (seconds: it imports torch and xgrammar
        and reads the tokenizer's description) and each side's first compile are paid before the
        first request. Call before any step (EngineCore does, at start-up)."""
        compiled, key = self._compile(WARMUP_GRAMMAR)
        compiled.result()
        matcher = next(self._ids)
        self._worker.step([[matcher, key]], [matcher], [], [], 0).result()

    def check(self, grammar: tuple[str, str]) -> None:
        """ValueError, with the library's reason, for a grammar it refuses. Fast (the grammar is
        only parsed); compiling it against the vocabulary is `matcher`'s, off this thread."""
        if grammar not in self._compiled:
            grammar_source(self._xgr, *grammar)

    def compile(self, grammar: tuple[str, str]) -> Future:
        """The CompiledGrammar of (kind, spec), as a Future: compiled once per spec (cached, the
        least recently used out past CACHE_ENTRIES) on a worker thread, since building the token
        masks of a 128k vocabulary takes up to ~1 s (docs/benchmarks/README.md) and the event loop must
        not stop for it; the grammar worker compiles it alongside. It raises ValueError if the
        library refuses the grammar."""
        return self._compile(grammar)[0]

    def _compile(self, grammar: tuple[str, str]) -> tuple[Future, int]:
        entry = self._compiled.get(grammar)
        if entry is not None:
            self._compiled.move_to_end(grammar)
            return entry
        source = grammar_source(self._xgr, *grammar)
        entry = (self._compile_pool.submit(self._compiler.compile_grammar, source), next(self._keys))
        self._worker.add_grammar(entry[1], grammar)
        self._compiled[grammar] = entry
        if len(self._compiled) > CACHE_ENTRIES:
            self._worker.forget_grammar(self._compiled.popitem(last=False)[1][1])
        return entry

    def matcher(self, grammar: tuple[str, str], replay: list[int] | None = None) -> "RequestGrammar":
        """A request's grammar state; its matcher is made in the worker when first used (by then
        its grammar is compiled: the compilation runs while the request queues and its prompt
        is computed). `replay`: output an earlier server produced (SamplingParams.resumed_output_tokens),
        which the matcher accepts as it is made, before any token of this request's own."""
        compiled, key = self._compile(grammar)
        request = RequestGrammar(self, compiled, next(self._ids), key)
        request.replay = list(replay or ())
        self._by_id[request.id] = request
        weakref.finalize(request, self._freed.append, request.id)
        return request

    def bitmask(self, reqs, samples: list[bool], launched: bool) -> "MaskFuture":
        """The batch's allowed tokens as a host int32 bitmask [B, words] (bit j of word w: token
        32 w + j), or None when no row samples under a grammar, as a future (`.result()`): the
        worker fills them while the caller goes on. Rows without a grammar allow everything.

        Call when every grammar request's matcher has accepted all its tokens but the one this
        batch samples (`launched`: the batch's own token is already counted as pending). A row
        whose matcher is terminated, or refused a token, keeps an all-ones row: its request is
        finished or failed, and its token is dropped on arrival. Take the result (and queue the
        copy that reads it) before the next call.
        """
        return self._submit([], [], reqs, samples, launched)

    def accept_and_fill(
        self, reqs, samples: list[bool], token_ids: list[int], next_reqs, next_samples: list[bool]
    ) -> "MaskFuture":
        """Advance the matchers of a processed batch's grammar rows by their new tokens, then fill
        the masks of the batch launched after it (`next_reqs`, whose sampling waits for them), both
        in the worker; the result is `bitmask`'s. Rows the scheduler will drop (not sampling, or
        results to discard) are left alone.

        The tokens are counted as accepted here, before the matchers see them, so the scheduler
        can process the batch at once (output_processor.append_token finds them accepted; a stop
        token terminates: the mask allowed one only where the grammar may end). A token a matcher
        refuses (a bug: the mask allows only what it accepts) is logged when the result is taken,
        and its request fails at its next token (RequestGrammar.accept).
        """
        accepting, tokens = [], []
        for req, sampling, token in zip(reqs, samples, token_ids):
            grammar = req.grammar
            if (
                grammar is None
                or not sampling
                or req.discard
                or req.finished
                or not grammar.usable()
                or req.params.max_new_tokens <= 0
            ):
                continue
            grammar.accepted_one(token)
            accepting.append(grammar)
            tokens.append(token)
        return self._submit(accepting, tokens, next_reqs, next_samples, launched=True)

    def _submit(self, accepting: list, tokens: list[int], reqs, samples: list[bool], launched: bool) -> "MaskFuture":
        """Send the worker one step: `tokens` to accept into the matchers of `accepting` (after
        any accepted outside a step), then the rows of the batch `reqs` to fill.

        NOTE this runs on the loop's thread for every grammar step: explicit loops, a few
        attribute reads per row (128 rows: ~0.1 ms)."""
        in_flight = 1 if launched else 0
        fills = []
        for i, (req, sampling) in enumerate(zip(reqs, samples)):
            grammar = req.grammar
            if grammar is None or not sampling or grammar.terminated or req.finished or not grammar.usable():
                continue
            # NOTE the matcher must have accepted exactly the tokens before the one this row
            # samples: the kept ones, and those in flight that will be kept (counted ahead by
            # accept_and_fill). A mask filled one token off would constrain the wrong position.
            assert grammar.accepted == len(req.output_ids) + req.pending - req.discard - in_flight, (
                req.rid,
                grammar.accepted,
                len(req.output_ids),
                req.pending,
                req.discard,
                in_flight,
            )
            if not grammar.announced:
                self._announce(grammar)
            fills.append([grammar.id, i])
        accepts, self._queued = self._queued, []
        for grammar, token in zip(accepting, tokens):
            accepts.append([grammar.id, token])
        new, self._new = self._new, []
        replayed, self._replayed = self._replayed, set()
        freed = self._freed.copy()  # (the same list: the finalizers hold its append)
        self._freed.clear()
        return MaskFuture(self._worker.step(new, freed, accepts, fills, len(reqs)), self._by_id, replayed)

    def _announce(self, grammar: "RequestGrammar") -> None:
        grammar.announced = True
        self._new.append([grammar.id, grammar.key])
        if grammar.replay:
            # NOTE queued before any token of the request's own (the callers queue theirs after this),
            # and counted in no `accepted`: that counts this server's output tokens only.
            self._queued += [[grammar.id, token] for token in grammar.replay]
            self._replayed.add(grammar.id)
            grammar.replay = []

    def queue_accept(self, grammar: "RequestGrammar", token: int) -> None:
        """A token accepted outside a step (a decode server's first, the serial loop's): the
        worker's matcher takes it at the start of the next step."""
        if not grammar.announced:
            self._announce(grammar)
        self._queued.append([grammar.id, token])


class MaskFuture:
    """A step's masks: `result()` waits for the worker, marks what it refused, gives the mask."""

    def __init__(self, step, by_id, replayed: set[int]):
        self._step, self._by_id, self._replayed = step, by_id, replayed

    def result(self) -> torch.Tensor | None:
        mask, refused = self._step.result()
        for request_id, token, reason in refused:
            grammar = self._by_id.get(request_id)
            if grammar is None or grammar.refused is not None:
                continue
            grammar.refused, grammar.failure = token, reason or None
            if request_id in self._replayed and not reason:  # the client's input, not a bug of ours
                grammar.replay_refused = True
                grammar.failure = (
                    f"token {token}, output before the stream moved (resumed_output_tokens), is outside "
                    "the request's grammar"
                )
            else:
                logger.error("a grammar refused token %d: its request fails at its next token", token)
        return mask


class RequestGrammar:
    """One request's place in its grammar, as the loop's thread counts it; its matcher lives in
    the grammar worker (made there when first used). A grammar whose compilation failed refuses
    every token (`failure` says why; the request then fails)."""

    __slots__ = (
        "_grammars",
        "_compiled",
        "id",
        "key",
        "announced",
        "accepted",
        "refused",
        "failure",
        "terminated",
        "replay",
        "replay_refused",
        "__weakref__",
    )

    def __init__(self, grammars: Grammars, compiled: Future, request_id: int, key: int):
        self._grammars, self._compiled = grammars, compiled
        self.id, self.key = request_id, key  # the worker's names for its matcher and its grammar
        self.announced = False  # the worker was told to make the matcher
        # Tokens accepted: len(req.output_ids), or one more when the engine counted the newest
        # token ahead of the scheduler's processing (Grammars.accept_and_fill: the worker's
        # matcher may still be accepting it).
        self.accepted = 0
        self.refused: int | None = None  # a token the grammar did not allow (a bug if ever set)
        self.failure: str | None = None
        # The grammar is complete and its stop token was accepted: xgrammar accepts a stop token
        # only where the grammar may end (the mask allows it nowhere else), and then terminates.
        self.terminated = False
        # Output an earlier server produced (Grammars.matcher), sent to the worker with the matcher;
        # `replay_refused`: the grammar refused one of those (the request fails as INVALID_REQUEST).
        self.replay: list[int] = []
        self.replay_refused = False

    def accepted_one(self, token: int) -> None:
        self.accepted += 1
        if token in self._grammars._stops:
            self.terminated = True

    def usable(self) -> bool:
        """Compiled (waiting for it if need be) and not failed."""
        if self.failure is None and not self.announced and self.refused is None:
            try:
                self._compiled.result()
            except ValueError as e:
                self.failure, self.refused = str(e), -1
        return self.failure is None and self.refused is None

    def accept(self, token: int, position: int) -> bool:
        """Advance by `token`, output token number `position` (0-based), unless that one was
        counted already (Grammars.accept_and_fill); False when the grammar failed or refused an
        earlier token (`refused` names it). The worker's matcher takes the token with the next
        step; should it refuse it (a bug: the mask allowed it), the request fails at its next."""
        if self.refused is not None:
            return False
        if self.accepted > position:
            return True
        if not self.usable():
            return False
        self._grammars.queue_accept(self, token)
        self.accepted_one(token)
        return True


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
