"""`pdserve bench spec-overlap` (bench/micro/spec_overlap.py) on a tiny model: the verify loop serial, overlapped and
auto on drafts of set acceptance, every answer the plain steps' (float32: the bench raises otherwise)."""

import json

from pdserve.common.cli import main


def test_the_report_times_each_overlap_mode_on_drafts_of_set_acceptance(tiny_models, tmp_path, capsys):
    out = tmp_path / "overlap.json"
    argv = ["bench", "spec-overlap", "--model-path", tiny_models("llama"), "--device", "cpu", "--dtype", "float32"]
    argv += ["--batch-size", "2", "--prompt-len", "12", "--output-len", "40", "--max-total-tokens", "2048"]
    assert main([*argv, "--output-json", str(out)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    report = json.loads(lines[-1])
    assert json.loads(out.read_text()) == report and any(line.startswith("B |") for line in lines)
    assert report["bench"] == "spec-overlap" and report["command"].startswith("pdserve bench spec-overlap")
    right, wrong = report["rows"]
    assert (right["wrong_every"], wrong["wrong_every"]) == (0, 3) and right["tokens"] == 80
    for row in (right, wrong):
        for mode in ("off", "on", "auto"):
            assert row[f"{mode}_answers_differing"] == 0 and row[f"{mode}_ms_per_token"] > 0
        # Serial steps lose no drafts; overlapped ones lose those that rode on a failed guess.
        assert row["off_counters"]["spec_unconfirmed_tokens"] == 0
    c = right["on_counters"]  # all right: every draft accepted, overlapped or not, 5 tokens a step
    assert c["spec_unconfirmed_tokens"] == 0 and c["spec_accepted_tokens"] == c["spec_proposed_tokens"] > 0
    assert right["off_counters"]["spec_verify_steps"] == c["spec_verify_steps"]
    # one draft in three wrong: overlapped steps lose drafts, auto (serial here) loses none
    assert wrong["on_counters"]["spec_unconfirmed_tokens"] > 0 == wrong["auto_counters"]["spec_unconfirmed_tokens"]
    assert wrong["on_counters"]["spec_verify_steps"] > wrong["off_counters"]["spec_verify_steps"]


def test_with_a_draft_model_the_engines_own_drafts_are_timed_in_each_mode(tiny_models, tmp_path, capsys):
    """--speculative draft: one row per batch size, the draft model's drafts (the target itself: all
    accepted, every guess held, so `on` and `auto` overlap), the answers the plain steps'."""
    path = tiny_models("llama")
    argv = ["bench", "spec-overlap", "--model-path", path, "--device", "cpu", "--dtype", "float32"]
    argv += ["--batch-size", "2", "--prompt-len", "12", "--output-len", "40", "--max-total-tokens", "2048"]
    assert main([*argv, "--speculative", "draft", "--draft-model-path", path]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    [row] = json.loads(lines[-1])["rows"]
    assert row["wrong_every"] is None and any("draft model" in line for line in lines)
    for mode in ("off", "on", "auto"):
        c = row[f"{mode}_counters"]
        assert row[f"{mode}_answers_differing"] == 0 and c["spec_accepted_tokens"] == c["spec_proposed_tokens"] > 0
    assert row["off_counters"]["spec_overlapped_steps"] == 0 < row["on_counters"]["spec_overlapped_steps"]
    assert row["auto_counters"]["spec_overlapped_steps"] > 0
