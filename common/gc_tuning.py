"""Python's cyclic garbage collector, kept out of the serving paths' way (process-wide settings)."""

from __future__ import annotations

import gc

YOUNG_GC_THRESHOLD = 10_000


def tune_gc() -> None:
    """Freeze the heap start-up built and collect the youngest generation less often.

    Called once a process has started (the engine's model and tokenizer loaded, the router's
    app built, a server's frontend serving, the load generator's client ready).

    NOTE: start-up leaves ~300k long-lived objects (modules, model, tokenizer); the first full
    collection after it stalled a generate for ~150 ms (2-core host). Frozen, the collector only
    walks what serving allocates (vLLM's engine core freezes too); an object alive now that later
    becomes cyclic garbage is never collected. And at the default threshold of 700 the youngest
    generation was collected ~2 times per GPT-2 offline run of 128 requests, ~0.65 ms each; at
    10,000 not once (nearly everything serving allocates is freed by reference counting first).
    In the router, unfrozen, the collector took 42% of a worker's samples while it streamed
    (each stream's objects live long enough to reach the oldest generation, and every full
    collection walked the whole start-up heap; docs/benchmarks/README.md).
    """
    gc.collect()
    gc.freeze()
    young, *older = gc.get_threshold()
    gc.set_threshold(max(young, YOUNG_GC_THRESHOLD), *older)
