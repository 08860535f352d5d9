"""bench/startup.py: a real `pdserve up` started, timed from its own lines, and stopped."""

import re

from pdserve.bench import startup


def test_a_start_is_timed_and_each_engines_phases_are_read(tiny_models, capsys):
    assert startup.main(["--model-path", tiny_models("llama"), "--starts", "1"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"start 1: up after \d+\.\d s", out) and "median: up after" in out
    phases = dict(
        re.findall(r"  (\w+): imports [\d.]+ s, config [\d.]+ s, tokenizer [\d.]+ s, weights .*total ([\d.]+) s", out)
    )
    assert set(phases) == {"Decode", "Prefill"} and all(float(t) > 0 for t in phases.values()), out
