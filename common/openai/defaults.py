"""What a request gets for the sampling fields it leaves out: the model's own generation defaults.

As vLLM's `--generation-config auto`: a Hugging Face checkpoint's `generation_config.json` (its
temperature, top_p, top_k, min_p, repetition_penalty and max_new_tokens), or a GGUF's
`general.sampling.*` metadata, replace OpenAI's defaults (temperature 1, top_p 1, ...) for every
request that does not set the field itself. `--generation-config none` keeps OpenAI's;
`--generation-config DIR` reads DIR/generation_config.json; `--override-generation-config JSON`
sets fields over either. `--default-max-tokens N` bounds a request without max_tokens (default:
the rest of the context, as OpenAI and vLLM).

Torch-free: the router loads it.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, fields, replace

from pdserve.common import gguf_checkpoint
from pdserve.common.config import option

# generation_config.json key -> our field; a GGUF's general.sampling.* key -> our field.
HF_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
GGUF_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}
CHOICES = "auto (the model's), none (OpenAI's) or a directory holding a generation_config.json"


# The flags that choose the defaults (the router's RouterConfig and run-batch's DefaultsFlags).
FLAG_HELP = {
    "generation_config": "Where sampling fields a request leaves out get their values: auto (the model's "
    "generation_config.json, or a GGUF's general.sampling.* metadata, where it has them; else OpenAI's), none "
    "(OpenAI's: temperature 1, top_p 1, ...) or a directory holding a generation_config.json.",
    "override_generation_config": "Sampling defaults set over --generation-config, as a JSON object, e.g. "
    '{"temperature": 0.2, "top_p": 0.9} (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens).',
    "default_max_tokens": "max_tokens of a request that gives none; 0: the rest of the context (OpenAI's and "
    "vLLM's default).",
}


@dataclass(frozen=True)
class DefaultsFlags:
    """run-batch's flags for the defaults (common/config.py add_cli_args)."""

    generation_config: str = option("auto", FLAG_HELP["generation_config"])
    override_generation_config: str = option("", FLAG_HELP["override_generation_config"])
    default_max_tokens: int = option(0, FLAG_HELP["default_max_tokens"])

    def sampling_defaults(self, model_path: str) -> GenerationDefaults:
        return load_generation_defaults(
            model_path, self.generation_config, self.override_generation_config, self.default_max_tokens
        )


@dataclass(frozen=True)
class GenerationDefaults:
    """The values a request's missing sampling fields take; `source` says where they came from."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = None  # None: the rest of the context
    source: str = "OpenAI's"

    def __post_init__(self) -> None:
        checks = {
            "temperature": (self.temperature, lambda v: 0 <= v <= 2, "between 0 and 2"),
            "top_p": (self.top_p, lambda v: 0 < v <= 1, "in (0, 1]"),
            "top_k": (self.top_k, lambda v: isinstance(v, int) and v >= -1, "an integer >= -1"),
            "min_p": (self.min_p, lambda v: 0 <= v <= 1, "in [0, 1]"),
            "repetition_penalty": (self.repetition_penalty, lambda v: 0 < v <= 2, "in (0, 2]"),
        }
        for name, (value, ok, what) in checks.items():
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not number or not math.isfinite(value) or not ok(value):
                raise ValueError(f"default {name} must be {what}, got {value!r} (from {self.source})")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise ValueError(f"default max_tokens must be a positive integer, got {self.max_tokens!r}")

    def changed(self) -> dict:
        """The fields that differ from OpenAI's defaults."""
        openai = GenerationDefaults()
        return {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if f.name != "source" and getattr(self, f.name) != getattr(openai, f.name)
        }

    def describe(self) -> str:
        """One line for the start-up log."""
        changed = self.changed()
        if not changed:
            return f"sampling defaults: {self.source} (temperature 1, top_p 1, max_tokens: the rest of the context)"
        if "max_tokens" not in changed:
            changed["max_tokens"] = "the rest of the context"
        return f"sampling defaults ({self.source}): " + ", ".join(f"{k} {v}" for k, v in changed.items())


def model_defaults(model_path: str) -> dict:
    """The generation defaults a checkpoint carries, as our field names ({} when it has none)."""
    gguf = gguf_checkpoint.gguf_file(model_path)
    if gguf is not None:
        metadata = gguf_checkpoint.read_info(gguf).metadata
        return {ours: metadata[key] for key, ours in GGUF_KEYS.items() if key in metadata}
    return _generation_config(model_path)


def _generation_config(directory: str) -> dict:
    path = os.path.join(directory, "generation_config.json")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        config = json.load(f)
    if not isinstance(config, dict):
        raise ValueError(f"{path} is not a JSON object")
    return {ours: config[key] for key, ours in HF_KEYS.items() if config.get(key) is not None}


def load_generation_defaults(
    model_path: str, generation_config: str = "auto", override: str = "", default_max_tokens: int = 0
) -> GenerationDefaults:
    """The defaults the flags ask for (see the module's docstring). ValueError names a bad flag."""
    if generation_config == "auto":
        values = model_defaults(model_path)
        source = "the model's generation config" if values else "OpenAI's; the model carries none"
    elif generation_config == "none":
        values, source = {}, "OpenAI's"
    elif os.path.isdir(generation_config):
        values, source = _generation_config(generation_config), f"{generation_config}/generation_config.json"
    else:
        raise ValueError(f"--generation-config must be {CHOICES}, got {generation_config!r}")
    if override:
        try:
            extra = json.loads(override)
        except json.JSONDecodeError as e:
            raise ValueError(f"--override-generation-config is not JSON: {e}") from None
        if not isinstance(extra, dict):
            raise ValueError("--override-generation-config must be a JSON object")
        unknown = sorted(set(extra) - set(HF_KEYS) - {"max_tokens"})
        if unknown:
            known = ", ".join(sorted(set(HF_KEYS) | {"max_tokens"}))
            raise ValueError(f"--override-generation-config: unknown field(s) {', '.join(unknown)} (known: {known})")
        values.update({HF_KEYS.get(k, k): v for k, v in extra.items()})
        source = f"--override-generation-config over {source}"
    if default_max_tokens:
        values["max_tokens"] = default_max_tokens
    try:
        return replace(GenerationDefaults(source=source), **values)
    except ValueError as e:
        raise ValueError(str(e)) from None
