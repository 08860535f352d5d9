"""Sampling defaults: what a request's missing fields take (common/openai/defaults.py) — the model's
generation config (a checkpoint's generation_config.json, a GGUF's general.sampling.*), the flags
over it, and the served model's short name."""

from __future__ import annotations

import json
import shutil

import pytest

from pdserve.common.config import short_model_name
from pdserve.common.openai.api import OpenAIError, parse_completion_request
from pdserve.common.openai.chat import parse_chat_request
from pdserve.common.openai.defaults import DefaultsFlags, GenerationDefaults, load_generation_defaults
from pdserve.common.tokenizer import load_tokenizer
from tests.tiny_gguf import write_gguf


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny llama with a generation_config.json as Hugging Face writes them."""
    from pdserve.common.tiny_model import make_tiny_model

    path = make_tiny_model(tmp_path_factory.mktemp("gen") / "tiny-chat", "llama", seed=0)
    (path / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 1, "do_sample": True, "temperature": 0.6, "top_p": 0.9, "max_new_tokens": 7})
    )
    return str(path)


def parse(body: dict, path: str, defaults: GenerationDefaults | None, **kw):
    return parse_completion_request(body, load_tokenizer(path), "tiny-chat", 512, defaults=defaults, **kw)


def test_a_checkpoints_generation_config_fills_what_the_request_leaves_out(checkpoint):
    defaults = load_generation_defaults(checkpoint)
    assert (defaults.temperature, defaults.top_p, defaults.max_tokens) == (0.6, 0.9, 7)
    assert "generation config" in defaults.describe() and "temperature 0.6" in defaults.describe()
    [p] = parse({"prompt": "hi"}, checkpoint, defaults).params
    assert (p.temperature, p.top_p, p.top_k, p.max_new_tokens) == (0.6, 0.9, -1, 7)
    # what the request says wins, 0 included
    [p] = parse({"prompt": "hi", "temperature": 0, "top_p": 1, "max_tokens": 30}, checkpoint, defaults).params
    assert (p.temperature, p.top_p, p.max_new_tokens) == (0.0, 1.0, 30)
    # OpenAI's defaults without the config (and with none given)
    for openai in (load_generation_defaults(checkpoint, "none"), None):
        parsed = parse({"prompt": "hi"}, checkpoint, openai)
        [p] = parsed.params
        assert (p.temperature, p.top_p) == (1.0, 1.0)
        assert p.max_new_tokens == 512 - len(parsed.prompts[0])  # the rest of the context


def test_chat_requests_take_the_defaults_too(checkpoint):
    defaults = load_generation_defaults(checkpoint, override='{"top_k": 20}', default_max_tokens=5)
    [p] = parse_chat_request(
        {"messages": [{"role": "user", "content": "hi"}]}, load_tokenizer(checkpoint), "m", 512, defaults=defaults
    ).params
    assert (p.temperature, p.top_k, p.max_new_tokens) == (0.6, 20, 5)


def test_flags_choose_and_override_the_defaults(checkpoint, tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.3, "repetition_penalty": 1.1}))
    from_dir = load_generation_defaults(checkpoint, str(tmp_path))
    assert (from_dir.temperature, from_dir.repetition_penalty, from_dir.top_p) == (0.3, 1.1, 1.0)
    over = load_generation_defaults(checkpoint, override='{"temperature": 0.2, "max_new_tokens": 64, "min_p": 0.05}')
    assert (over.temperature, over.top_p, over.max_tokens, over.min_p) == (0.2, 0.9, 64, 0.05)
    assert "--override-generation-config" in over.source
    capped = DefaultsFlags(generation_config="none", default_max_tokens=16).sampling_defaults(checkpoint)
    assert (capped.temperature, capped.max_tokens) == (1.0, 16)
    # the default bounds a request without max_tokens, never one that gives it, nor past the context
    [p] = parse({"prompt": "hi"}, checkpoint, capped).params
    assert p.max_new_tokens == 16
    [p] = parse({"prompt": "hi", "max_tokens": 100}, checkpoint, capped).params
    assert p.max_new_tokens == 100
    huge = load_generation_defaults(checkpoint, "none", default_max_tokens=10**6)
    parsed = parse({"prompt": "hi"}, checkpoint, huge)
    assert parsed.params[0].max_new_tokens == 512 - len(parsed.prompts[0])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"generation_config": "greedy"}, "--generation-config must be"),
        ({"override": "{temperature: 1}"}, "not JSON"),
        ({"override": "[1]"}, "JSON object"),
        ({"override": '{"temprature": 0.5}'}, "unknown field(s) temprature"),
        ({"override": '{"temperature": 3}'}, "temperature must be between 0 and 2"),
        ({"override": '{"top_p": 0}'}, "top_p must be in (0, 1]"),
        ({"override": '{"top_k": 1.5}'}, "top_k must be an integer"),
        ({"override": '{"temperature": "hot"}'}, "temperature must be"),
    ],
)
def test_bad_defaults_are_refused_naming_the_flag_or_field(checkpoint, kwargs, message):
    with pytest.raises(ValueError, match=None) as e:
        load_generation_defaults(checkpoint, **kwargs)
    assert message in str(e.value)


def test_a_bad_generation_config_in_the_checkpoint_is_refused_at_start(checkpoint, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(checkpoint, bad)
    (bad / "generation_config.json").write_text(json.dumps({"temperature": -1}))
    with pytest.raises(ValueError, match="temperature must be between 0 and 2"):
        load_generation_defaults(str(bad))


def test_a_ggufs_sampling_metadata_gives_the_defaults(tiny_models, tmp_path):
    sampling = {"general.sampling.temp": 0.7, "general.sampling.top_k": 40, "general.sampling.top_p": 0.95}
    with_them = write_gguf(tiny_models("llama"), tmp_path / "with.gguf", metadata=sampling)
    defaults = load_generation_defaults(str(with_them))
    assert (defaults.top_k, defaults.max_tokens) == (40, None)
    assert defaults.temperature == pytest.approx(0.7) and defaults.top_p == pytest.approx(0.95)
    without = load_generation_defaults(str(write_gguf(tiny_models("llama"), tmp_path / "without.gguf")))
    assert without.changed() == {} and "carries none" in without.source


def test_the_model_is_served_under_its_short_name_and_its_path(checkpoint):
    assert short_model_name(checkpoint) == "tiny-chat"
    assert short_model_name("/models/SmolLM2-135M-Instruct.Q4_1.gguf") == "SmolLM2-135M-Instruct.Q4_1"
    assert short_model_name("/models/Llama-3.2-1B/") == "Llama-3.2-1B"
    for name in ("tiny-chat", checkpoint):
        assert parse({"prompt": "hi", "model": name}, checkpoint, None, aliases=(checkpoint,)).model == "tiny-chat"
    with pytest.raises(OpenAIError) as e:
        parse({"prompt": "hi", "model": "tiny"}, checkpoint, None, aliases=(checkpoint,))
    assert e.value.status_code == 404
