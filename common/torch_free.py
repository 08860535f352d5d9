"""Processes that only tokenize (the router's) run without torch.

transformers imports torch wherever it is installed (its configuration module does, and every
tokenizer class imports that), though a tokenizer and its chat template use none of it: ~1-1.6 s and
~180 MB of every router process (docs/benchmarks/startup-and-small-models.md). transformers 5 has no
switch for it, but it decides whether torch is there with `importlib.util.find_spec("torch")`, which
answers None when sys.modules holds None under the name: Python's own mark for "not importable" (an
`import torch` then raises ImportError). A router process sets that mark before it first imports
transformers, which then runs as on a host without torch: the same tokenizer class, ids and chat
template (tests/test_router_torch_free.py). The one thing that needs torch, converting a GGUF's
tokenizer, runs once in a child process and is cached (common/gguf_tokenizer.py).
"""

from __future__ import annotations

import logging
import sys

log = logging.getLogger(__name__)

# What transformers logs once, at import, without torch: true of this process, but read on a GPU
# host it would say something is wrong.
NO_TORCH_NOTICE = "PyTorch was not found"


def keep_torch_out() -> None:
    """Makes torch unimportable in this process, for good (a second call does nothing).

    NOTE: before transformers is imported: it asks whether torch is there once per process
    (is_torch_available is cached) and imports torch when it is. Called later, it only warns: marking
    torch then would break a transformers that counts on it, and the process works with torch, only
    heavier (tests/test_router_torch_free.py is what holds the router to it)."""
    if torch_kept_out():
        return
    late = [name for name in ("torch", "transformers") if name in sys.modules]
    if late:
        log.warning("%s imported already: this process keeps torch (memory, start time)", " and ".join(late))
        return
    sys.modules["torch"] = None  # type: ignore[assignment]
    logging.getLogger("transformers").addFilter(lambda record: NO_TORCH_NOTICE not in record.getMessage())


def torch_kept_out() -> bool:
    return "torch" in sys.modules and sys.modules["torch"] is None


def transformers_without_torch(tokenizers: bool = True) -> None:
    """In a process that has torch (a server's scheduler): import transformers as if torch were not
    installed, then give torch back. The process tokenizes with transformers and computes with torch.

    NOTE why: with torch importable, `from transformers import AutoTokenizer` imports transformers'
    model stack (torch.distributed.tensor and its custom ops, the generation utilities, scikit-learn
    where it is installed): 8-14 s of each server's start-up on the GPU hosts (`tokenizer` phase,
    docs/benchmarks/startup-and-small-models.md), for a tokenizer that uses none of it.
    transformers asks once whether torch is there (is_torch_available is cached at its import), so
    hiding torch for the import is enough: afterwards the module `torch` is the real one again for
    everything else, and transformers keeps to its torch-free paths (the router's tokenizer: the same
    ids and chat template, tests/test_router_torch_free.py). Not for a process that also runs
    transformers' models (a test comparing with them): call it only where transformers is not yet
    imported and never will load a model; otherwise it does nothing. `tokenizers`: also import the
    tokenizer classes now (a server's scheduler, which loads its tokenizer next; the grammar worker,
    which only needs what xgrammar imports, passes False)."""
    if "transformers" in sys.modules or torch_kept_out():
        return
    logging.getLogger("transformers").addFilter(lambda record: NO_TORCH_NOTICE not in record.getMessage())
    torch = sys.modules.get("torch")
    sys.modules["torch"] = None  # type: ignore[assignment]
    try:
        import transformers  # noqa: F401 (its modules imported later read the cached answer: no torch)

        if tokenizers:  # (inside the window, as measured on the H200 host: the tokenizer classes' modules)
            from transformers import AutoTokenizer, PreTrainedTokenizerFast  # noqa: F401
            from transformers.configuration_utils import PreTrainedConfig  # noqa: F401
    finally:
        if torch is None:
            del sys.modules["torch"]
        else:
            sys.modules["torch"] = torch
