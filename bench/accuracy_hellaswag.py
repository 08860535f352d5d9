"""HellaSwag in `pdserve bench accuracy`: lm-evaluation-harness's zero-shot `hellaswag` task, as
its `local-completions` model computes it against an OpenAI server.

Context: lm-eval's query, preprocess(activity_label + ": " + ctx_a + " " + ctx_b.capitalize()).
Continuations: " " + preprocess(ending) for the four endings. Tokens: lm-eval's _encode_pair for a
causal model (the whole string tokenized, the continuation is what follows the context's own
tokens; no BOS, as `add_bos_token` defaults to False). Each (context, ending) is one request of
token ids with echo + logprobs, the continuation's logprobs summed; acc picks the highest sum,
acc_norm the highest sum per character of the ending.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from statistics import fmean

from pdserve.bench.accuracy_client import OpenAIEndpoint


def preprocess(text: str) -> str:
    """lm-eval's hellaswag `preprocess` (lm_eval/tasks/hellaswag/utils.py), unchanged."""
    text = text.strip()
    # NOTE: brackets are artifacts of the WikiHow part of HellaSwag.
    text = text.replace(" [title]", ". ")
    text = re.sub("\\[.*?\\]", "", text)
    text = text.replace("  ", " ")
    return text


def split_context(ctx: str) -> tuple[str, str]:
    """(ctx_a, ctx_b) of a fixture's `ctx`, which is the dataset's ctx_a + " " + ctx_b.

    NOTE: lm-eval builds its query from ctx_a and ctx_b.capitalize(), but the fixture keeps only
    their join. In the ActivityNet rows ctx_b is the lowercased start of a sentence ("the man",
    "they") after ctx_a's last full stop; WikiHow rows mostly have none. So a tail after the last
    sentence end that starts lowercase and holds no sentence end is taken for ctx_b, else ctx_b
    is ''. A row whose real ctx_b is otherwise (uppercase, several sentences, a WikiHow ctx_b that
    capitalize() would lowercase) differs from lm-eval's query in letter case only."""
    match = re.fullmatch(r"(.*[.!?])\s+([a-z][^.!?]*)", ctx, flags=re.S)
    if match is None:
        return ctx, ""
    return match.group(1), match.group(2)


def query(item: dict) -> str:
    ctx_a, ctx_b = split_context(item["ctx"])
    return preprocess(item["activity_label"] + ": " + ctx_a + " " + ctx_b.capitalize())


def choices(item: dict) -> list[str]:
    return [preprocess(ending) for ending in item["endings"]]


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's TemplateLM._encode_pair (causal model, API tokenizer without special tokens):
    the context's trailing spaces move to the continuation, the whole string is tokenized, and
    the continuation is what follows the context's own tokens in it."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        continuation = context[-spaces:] + continuation
        context = context[:-spaces]
    whole = tokenizer(context + continuation, add_special_tokens=False)["input_ids"]
    context_ids = tokenizer(context, add_special_tokens=False)["input_ids"]
    return context_ids, whole[len(context_ids) :]


def pick(scores: list[float]) -> int:
    """The index of the highest score, the first one on a tie (as numpy's argmax)."""
    best = 0
    for index, value in enumerate(scores):
        if value > scores[best]:
            best = index
    return best


def picks(loglikelihoods: list[float], endings: list[str]) -> tuple[int, int]:
    """(acc's pick, acc_norm's pick). lm-eval's acc_norm divides by len(choice): the ending's
    length in characters (bytes only where it is ASCII), without the leading space."""
    return pick(loglikelihoods), pick([ll / len(ending) for ll, ending in zip(loglikelihoods, endings)])


@dataclass
class HellaSwagPlan:
    items: list[dict]
    choices: list[list[str]]  # per item: its preprocessed endings
    pairs: list[list[tuple[list[int], list[int]]]]  # per item, per ending: (context ids, continuation ids)


def plan(items: list[dict], tokenizer) -> HellaSwagPlan:
    all_choices, all_pairs = [], []
    for item in items:
        context, endings = query(item), choices(item)
        all_choices.append(endings)
        all_pairs.append([encode_pair(tokenizer, context, " " + ending) for ending in endings])
    return HellaSwagPlan(items, all_choices, all_pairs)


def serve(endpoint: OpenAIEndpoint, plan: HellaSwagPlan, concurrency: int) -> list[dict]:
    """Per item: {"loglikelihoods": one per ending} from pdserve, or {"error"}.

    The prompt is scored and nothing generated: max_tokens 0 (lm-eval sends 1 and drops the
    generated token's entry; docs/lm-eval.md). NOTE: the echoed prompt leads `token_logprobs`
    (its first entry null) and nothing follows it, so the list is exactly as long as the prompt."""
    flat = [pair for pairs in plan.pairs for pair in pairs]
    bodies = [
        {"prompt": context + continuation, "max_tokens": 0, "temperature": 0, "echo": True, "logprobs": 0}
        for context, continuation in flat
    ]
    answers = iter(endpoint.post_all("/v1/completions", bodies, concurrency))
    served = []
    for pairs in plan.pairs:
        sums, errors = [], []
        for (context, continuation), answer in zip(pairs, answers):
            if answer.body is None:
                errors.append(answer.error)
                continue
            logprobs = answer.body["choices"][0]["logprobs"]["token_logprobs"]
            if len(logprobs) != len(context) + len(continuation):
                errors.append(f"{len(logprobs)} echoed logprobs for a prompt of {len(context) + len(continuation)}")
                continue
            sums.append(sum(logprobs[len(context) :]))
        served.append({"error": errors[0]} if errors else {"loglikelihoods": sums})
    return served


def reference(model, plan: HellaSwagPlan, device: str) -> list[list[float]]:
    """transformers' continuation loglikelihoods, per item and ending."""
    from pdserve.bench.accuracy_hf import continuation_logprobs

    return [continuation_logprobs(model, pairs, device) for pairs in plan.pairs]


def score(plan: HellaSwagPlan, served: list[dict], ref: list[list[float]] | None) -> dict:
    """acc and acc_norm of pdserve (and of the reference), per-item records, their agreement on
    the chosen ending and the largest |difference| of a continuation's loglikelihood."""
    records = []
    for index, (item, answer) in enumerate(zip(plan.items, served)):
        gold = int(item["expected_index"])
        record = {"id": item["id"], "gold": gold, "error": answer.get("error", "")}
        ll = answer.get("loglikelihoods")
        record["pdserve_loglikelihoods"] = ll
        record["pdserve_pick"], record["pdserve_pick_norm"] = picks(ll, plan.choices[index]) if ll else (None, None)
        if ref is not None:
            record["hf_loglikelihoods"] = ref[index]
            record["hf_pick"], record["hf_pick_norm"] = picks(ref[index], plan.choices[index])
            record["agree"] = record["pdserve_pick"] == record["hf_pick"]
            record["agree_norm"] = record["pdserve_pick_norm"] == record["hf_pick_norm"]
            record["max_abs_diff"] = max(abs(a - b) for a, b in zip(ll, ref[index])) if ll else None
        records.append(record)
    summary = {
        "n": len(records),
        "failed": sum(1 for r in records if r["error"]),
        "pdserve": _accuracies(records, "pdserve"),
        "hf": None,
        "agreement": None,
    }
    if ref is not None:
        diffs = [r["max_abs_diff"] for r in records if r["max_abs_diff"] is not None]
        summary |= {
            "hf": _accuracies(records, "hf"),
            "agreement": fmean(r["agree"] for r in records),
            "agreement_norm": fmean(r["agree_norm"] for r in records),
            "max_abs_logprob_diff": max(diffs) if diffs else None,
        }
    summary["items"] = records
    return summary


def _accuracies(records: list[dict], who: str) -> dict:
    return {
        "acc": fmean(r[f"{who}_pick"] == r["gold"] for r in records),
        "acc_norm": fmean(r[f"{who}_pick_norm"] == r["gold"] for r in records),
    }


def table_rows(summary: dict) -> list[list[str]]:
    hf, diff = summary["hf"], summary.get("max_abs_logprob_diff")
    rows = []
    for metric, agreement in (("acc", summary["agreement"]), ("acc_norm", summary.get("agreement_norm"))):
        rows.append(
            [
                "hellaswag",
                metric,
                f"{summary['pdserve'][metric]:.3f}",
                "-" if hf is None else f"{hf[metric]:.3f}",
                "-" if agreement is None else f"{agreement:.1%}",
                "-" if diff is None else f"{diff:.2e}",
            ]
        )
    return rows
