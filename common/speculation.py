"""The speculative decoding flags' checks (EngineConfig.resolve): what is built, and where it runs.

Torch-free, like config.py. The machinery is common/engine/speculative/ (proposers, verification, the
verify step) and common/scheduling/speculation.py (drafts, pages, acceptance); docs/architecture.md,
"Speculative decoding".
"""

from __future__ import annotations

PROPOSERS = ("ngram",)  # --speculative choices that are built ("" is off)
PLANNED = ("draft", "eagle")  # named in the design, not built yet


def check_speculative(config) -> None:
    """ValueError, naming the flag, for a speculative set-up the engine does not run (yet)."""
    kind = config.speculative
    if not kind:
        return
    if kind in PLANNED:
        raise ValueError(f"--speculative {kind} is not yet built; --speculative ngram is")
    if kind not in PROPOSERS:
        raise ValueError(f"--speculative must be ngram (or empty: off), got {kind!r}")
    if config.num_speculative_tokens < 1:
        raise ValueError(f"--num-speculative-tokens must be >= 1, got {config.num_speculative_tokens}")
    if not 1 <= config.speculative_ngram_min <= config.speculative_ngram_max:
        raise ValueError(
            "--speculative-ngram-min and --speculative-ngram-max must satisfy 1 <= min <= max, got "
            f"{config.speculative_ngram_min} and {config.speculative_ngram_max}"
        )
    if config.tp_size > 1:
        # NOTE the other ranks replay rank 0's launches (tp_worker.follow): a verify batch's every-position
        # logits and its token count per request are not in that protocol yet.
        raise ValueError("--speculative needs --tp-size 1 for now")
