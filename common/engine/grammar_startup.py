"""Structured output's machinery made during the engine's start-up, beside the model's loading.

    grammars = GrammarsAtStart(config, tokenizer, eos_token_ids, fence, warm)   # warm: a thread starts
    grammars.wait()       # at the end of the start-up: True once they are made (or failed, logged)
    grammars.get()        # the Grammars (common/engine/grammar.py); made here and now if not yet

Why at start-up: made on the first grammar request, they cost that request the import of xgrammar,
the tokenizer's description over the whole vocabulary, the grammar worker's start (a process that
imports torch and xgrammar: seconds) and both sides' first compile — on the prefill server and
again on the decode server (the README's parse() example, greedy, SmolLM2 on the 2-core CPU box:
7.0 s against 2.85 s for the next one; now 2.9 s; docs/benchmarks/structured-outputs-and-accuracy.md). Why a thread: the
worker starts in its own process, on another core, and the parent's part overlaps the model's
loading; the engine waits for what is left before it says it is ready (start-up phase "grammars").

Warm in a prefill or decode server by default; the offline engine (run-batch, the Python API, most
tests) and a server with --disable-grammar-warmup (one that never serves a grammar: no worker
process) make them on the first grammar request instead. A start-up that fails is logged
and retried then: a server whose tokenizer xgrammar cannot describe still serves everything else.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future

from pdserve.common.config import EngineConfig, read_hf_config
from pdserve.common.engine import grammar_prefork
from pdserve.common.engine.grammar import Grammars
from pdserve.common.engine.grammar_worker import GrammarWorker, fill_threads

logger = logging.getLogger(__name__)


class GrammarsAtStart:
    def __init__(self, config: EngineConfig, tokenizer, eos_token_ids: tuple[int, ...], fence, warm: bool):
        """`config`: the engine's, resolved; `fence`: Grammars' (CUDA: the masks are pinned; None on
        CPU); `warm`: start making them now."""
        self._args = (config.model_path, tokenizer, eos_token_ids, fence)
        self._made: Future | None = None
        self._grammars: Grammars | None = None
        if warm:
            self._made = Future()
            # NOTE the worker is spawned here, on the engine's thread: it dies with the thread that
            # spawned it (GrammarWorker), and the start-up's thread ends.
            # (a server's scheduler process forked it at its start: common/engine/grammar_prefork.py)
            worker = GrammarWorker(fill_threads(), forked=grammar_prefork.take())
            # (a daemon thread: an engine whose start fails is not kept from exiting by it)
            threading.Thread(target=self._warm, args=(worker,), name="grammar-startup", daemon=True).start()

    def _make(self, worker: GrammarWorker | None = None) -> Grammars:
        model_path, tokenizer, eos_token_ids, fence = self._args
        # (the model's vocabulary, padding ids included: read here, the runner may not exist yet)
        vocab_size = read_hf_config(model_path)["vocab_size"]
        return Grammars(tokenizer, vocab_size, eos_token_ids, pin_memory=fence is not None, fence=fence, worker=worker)

    def _warm(self, worker: GrammarWorker) -> None:
        try:
            grammars = self._make(worker)
            grammars.warm_up()
        except Exception as e:  # (wait() logs it)
            worker.close()
            self._made.set_exception(e)
        else:
            self._made.set_result(grammars)

    def wait(self) -> bool:
        """Wait for the start-up's thread; False when there is none (not `warm`)."""
        if self._made is None:
            return False
        try:
            self._grammars = self._made.result()
        except Exception:
            logger.exception("structured output failed to start; the first grammar request tries again")
        self._made = None
        return True

    def get(self) -> Grammars:
        if self._made is not None:
            self.wait()
        if self._grammars is None:
            self._grammars = self._make()
        return self._grammars
