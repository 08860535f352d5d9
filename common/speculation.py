"""The speculative decoding flags' checks (EngineConfig.resolve): what is built, and where it runs.

Torch-free, like config.py. The machinery is common/engine/speculative/ (proposers, verification, the
verify step) and common/scheduling/speculation.py (drafts, pages, acceptance); docs/architecture.md,
"Speculative decoding".
"""

from __future__ import annotations

from pdserve.common.model_checks import check_model_path

PROPOSERS = ("ngram", "draft")  # --speculative choices that are built ("" is off)
PLANNED = ("eagle",)  # named in the design, not built yet

# --speculative-max-batch's default: decode steps of more requests run plain, where verifying 1 + k positions
# per request costs more than the drafts it accepts return (the step turns compute-bound as the batch grows).
# Measured on an H200 (`python -m pdserve.bench.micro.verify_step --batch-size 1 8 32 128`, verify steps replayed
# from CUDA graphs; docs/benchmarks/speculative.md, "The verify step"): a verify step of k = 4 costs 1.09-1.16x
# the plain decode step at batch 1 and 8, 1.37-1.39x at 32, 2.7-3.2x at 128 (Llama-1B and 8B shapes). Up to 8 a workload
# that keeps one draft in six still gains; a copy-heavy one keeping ~2.4 drafts a step (SmolLM2-135M on
# bench/micro/copy_workload.py, `pdserve bench spec-itl`) pays at 32 too (raise the flag).
SPECULATIVE_MAX_BATCH = 8


def check_speculative(config, read_hf_config) -> None:
    """ValueError, naming the flag, for a speculative set-up the engine does not run (yet).
    `read_hf_config`: a checkpoint's config.json fields (config.py's)."""
    kind = config.speculative
    if config.draft_model_path and kind != "draft":
        raise ValueError(f"--draft-model-path is for --speculative draft, got --speculative {kind!r}")
    if not kind:
        return
    if kind in PLANNED:
        raise ValueError(f"--speculative {kind} is not yet built; --speculative ngram and draft are")
    if kind not in PROPOSERS:
        raise ValueError(f"--speculative must be ngram or draft (or empty: off), got {kind!r}")
    if kind == "draft":
        check_draft_model(config, read_hf_config)
    if config.num_speculative_tokens < 1:
        raise ValueError(f"--num-speculative-tokens must be >= 1, got {config.num_speculative_tokens}")
    if config.speculative_overlap not in ("auto", "on", "off"):
        raise ValueError(f"--speculative-overlap must be auto, on or off, got {config.speculative_overlap!r}")
    if config.speculative_max_batch < 0:
        raise ValueError(f"--speculative-max-batch must be >= 0 (0: no limit), got {config.speculative_max_batch}")
    if not 1 <= config.speculative_ngram_min <= config.speculative_ngram_max:
        raise ValueError(
            "--speculative-ngram-min and --speculative-ngram-max must satisfy 1 <= min <= max, got "
            f"{config.speculative_ngram_min} and {config.speculative_ngram_max}"
        )


def check_draft_model(config, read_hf_config) -> None:
    """--speculative draft: a draft checkpoint there is, whose vocabulary is the target's (its token ids are
    the target's drafts, compared id for id)."""
    path = config.draft_model_path
    if not path:
        raise ValueError("--speculative draft needs --draft-model-path (a small model with the target's vocabulary)")
    try:
        check_model_path(path)
    except ValueError:
        raise ValueError(
            f"--draft-model-path {path!r} has no config.json and is not a .gguf file (or a directory holding one)"
        ) from None
    draft, target = read_hf_config(path).get("vocab_size"), read_hf_config(config.model_path).get("vocab_size")
    if draft != target:
        raise ValueError(
            f"--draft-model-path {path!r} has a vocabulary of {draft} tokens, the target model {target}: "
            "a draft model must share the target's tokenizer and vocabulary"
        )
