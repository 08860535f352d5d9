"""`pdserve bench spec-replay`: n-gram speculation's acceptance replayed from greedy answers
(bench/micro/spec_replay.py), and the copy-heavy workload (bench/micro/copy_workload.py)."""

import json

from pdserve.bench.micro.spec_replay import replay


def test_a_replay_takes_the_drafts_the_answer_confirms_and_one_token_more():
    # step 1: the suffix (8,) ... (5, 6, 7, 8) occurred nowhere before: no draft, the target's 5;
    # step 2: (5,) ended at 1 before: drafts 6 7 8 (at most 3: one answer token must stay the
    # target's), all confirmed, and the target's 9 ends the answer.
    assert replay([5, 6, 7, 8], [5, 6, 7, 8, 9], k=4) == (2, 3, 3)
    # the same with one draft a step: 5 | 6 (drafted 6) 7 | ... every step accepts its draft
    assert replay([5, 6, 7, 8], [5, 6, 7, 8, 9], k=1) == (3, 2, 2)
    # 7 | (7,) occurred: drafts 1 2, the answer says 1 5: one accepted, the target's 5 | 6
    assert replay([7, 1, 2], [7, 1, 5, 6], k=2) == (3, 2, 1)
    # nothing to copy: one token a step
    assert replay([1, 2, 3], [4, 5, 6], k=4) == (3, 0, 0)


def test_copy_requests_accept_drafts_on_the_real_model(capsys):
    """SmolLM2 rewriting and quoting passages repeats them: fewer verify steps than tokens."""
    from pdserve.common.cli import main
    from tests.real_model import smollm2_gguf_path

    argv = ["bench", "spec-replay", "--model-path", smollm2_gguf_path(), "--device", "cpu"]
    assert main([*argv, "--num-prompts", "3", "--output-len", "32", "--num-speculative-tokens", "1", "4"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    one, four = report["rows"]
    assert (one["k"], four["k"]) == (1, 4) and one["plain_steps"] == four["plain_steps"] > 0
    # Drafts were accepted. k = 4 never takes more steps than k = 1 (its first draft is k = 1's), but
    # whether it takes fewer depends on the answers: a few short greedy answers on this CPU sometimes
    # hold no run of two accepted drafts (a CI run: 147 steps both), so that is not asserted.
    assert four["steps"] <= one["steps"] < one["plain_steps"]
    assert 1 < one["tokens_per_step"] <= four["tokens_per_step"] <= 5
    # Greedy answers copy their passage (3.2 tokens a step at k = 4 here); answers sampled at temperature
    # 1 (SamplingParams' default, once used here by mistake) paraphrase it: ~1.2.
    assert four["tokens_per_step"] > 2
