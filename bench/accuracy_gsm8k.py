"""GSM8K in `pdserve bench accuracy`: greedy generation, exact match on the final number.

Zero-shot, through /v1/chat/completions when the checkpoint has a chat template (the instruction
asks for a last line 'The answer is N.'), else /v1/completions with 'Question: ...\\nAnswer:
Let's think step by step.' stopped at the next '\\nQuestion:'. The answer is the last number of
the text, normalized (commas and '$' dropped, '18.0' -> '18'); the fixture's `expected` is too.
The reference tokenizes as the server does (chat: the template's text, no special tokens added;
completions: special tokens added), so each item also records whether the ids the server
reports for its prompt equal the reference's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from statistics import fmean

from pdserve.bench.accuracy_client import OpenAIEndpoint

INSTRUCTION = (
    "Solve the problem step by step. End with a last line of the form 'The answer is N.', where N is the final number."
)
STOP = "\nQuestion:"  # completions: a model going on to a next question has answered this one
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def normalize_number(text: str) -> str | None:
    """'1,234.50' -> '1234.5', '18.0' -> '18', '-0' -> '0'; None for what is not a number."""
    try:
        value = Decimal(text.replace(",", "").replace("$", "").strip())
    except InvalidOperation:
        return None
    if not value.is_finite():
        return None
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")


def extract_answer(text: str) -> str | None:
    """The last number in a generated answer, normalized; None when it holds none."""
    found = NUMBER.findall(text)
    return normalize_number(found[-1]) if found else None


def cut_at_stop(text: str, stop: str | None) -> str:
    """What a server returns for a `stop` string: the text before its first occurrence."""
    if stop is None or stop not in text:
        return text
    return text[: text.index(stop)]


@dataclass
class GSM8KPlan:
    items: list[dict]
    chat: bool  # /v1/chat/completions (else /v1/completions)
    prompts: list  # per item: chat messages, or the completions prompt text
    prompt_ids: list[list[int]]  # per item: the prompt as the reference tokenizes it
    max_tokens: int
    stop: str | None  # completions only


def plan(items: list[dict], tokenizer, endpoint: str, max_tokens: int) -> GSM8KPlan:
    """`endpoint`: chat, completions, or auto (chat when the tokenizer has a chat template)."""
    chat = endpoint == "chat" or (endpoint == "auto" and bool(getattr(tokenizer, "chat_template", None)))
    prompts, prompt_ids = [], []
    for item in items:
        if chat:
            messages = [{"role": "user", "content": f"{item['prompt']}\n\n{INSTRUCTION}"}]
            # As the server renders a conversation (common/openai/chat.py): the template's text
            # already holds BOS, so no special tokens are added again.
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            prompts.append(messages)
            prompt_ids.append(tokenizer(text, add_special_tokens=False)["input_ids"])
        else:
            text = f"Question: {item['prompt']}\nAnswer: Let's think step by step."
            prompts.append(text)
            prompt_ids.append(tokenizer(text, add_special_tokens=True)["input_ids"])
    return GSM8KPlan(items, chat, prompts, prompt_ids, max_tokens, None if chat else STOP)


def serve(endpoint: OpenAIEndpoint, plan: GSM8KPlan, concurrency: int) -> list[dict]:
    """Per item: {"text", "prompt_ids"} of pdserve's answer, or {"error"}."""
    bodies = []
    for prompt in plan.prompts:
        body = {"max_tokens": plan.max_tokens, "temperature": 0, "return_token_ids": True}
        if plan.chat:
            bodies.append({"messages": prompt, **body})
        else:
            bodies.append({"prompt": prompt, "stop": [plan.stop], **body})
    path = "/v1/chat/completions" if plan.chat else "/v1/completions"
    served = []
    for answer in endpoint.post_all(path, bodies, concurrency):
        if answer.body is None:
            served.append({"error": answer.error})
            continue
        choice = answer.body["choices"][0]
        text = choice["message"]["content"] if plan.chat else choice["text"]
        served.append({"text": text or "", "prompt_ids": choice.get("prompt_token_ids")})
    return served


def reference(model, tokenizer, plan: GSM8KPlan, eos_ids: tuple[int, ...], device: str) -> list[str]:
    """transformers' greedy answer to every prompt, as the text the server would return."""
    from pdserve.bench.accuracy_hf import generate_greedy

    texts = []
    for tokens in generate_greedy(model, plan.prompt_ids, plan.max_tokens, eos_ids, device):
        if tokens and tokens[-1] in eos_ids:
            tokens = tokens[:-1]  # the server stops at an EOS without returning its text
        texts.append(cut_at_stop(tokenizer.decode(tokens, skip_special_tokens=True), plan.stop))
    return texts


def score(plan: GSM8KPlan, served: list[dict], ref_texts: list[str] | None) -> dict:
    """exact_match of pdserve (and of the reference), per-item records, and their agreement."""
    records = []
    for index, (item, answer) in enumerate(zip(plan.items, served)):
        expected = normalize_number(item["expected"])
        record = {"id": item["id"], "expected": expected, "error": answer.get("error", "")}
        record["pdserve_text"] = answer.get("text", "")
        record["pdserve_answer"] = extract_answer(record["pdserve_text"]) if not record["error"] else None
        record["pdserve_correct"] = not record["error"] and record["pdserve_answer"] == expected
        if ref_texts is not None:
            record["hf_text"] = ref_texts[index]
            record["hf_answer"] = extract_answer(ref_texts[index])
            record["hf_correct"] = record["hf_answer"] == expected
            record["agree"] = not record["error"] and record["pdserve_answer"] == record["hf_answer"]
            record["same_text"] = not record["error"] and record["pdserve_text"] == record["hf_text"]
            record["prompt_ids_equal"] = answer.get("prompt_ids") == plan.prompt_ids[index]
        records.append(record)
    summary = {
        "n": len(records),
        "endpoint": "chat" if plan.chat else "completions",
        "max_tokens": plan.max_tokens,
        "failed": sum(1 for r in records if r["error"]),
        "pdserve": {"exact_match": fmean(r["pdserve_correct"] for r in records)},
        "hf": None,
        "agreement": None,
    }
    if ref_texts is not None:
        summary["hf"] = {"exact_match": fmean(r["hf_correct"] for r in records)}
        summary["agreement"] = fmean(r["agree"] for r in records)
        summary["same_text"] = fmean(r["same_text"] for r in records)
        summary["prompt_ids_equal"] = fmean(r["prompt_ids_equal"] for r in records)
    summary["items"] = records
    return summary


def table_rows(summary: dict) -> list[list[str]]:
    hf, agree = summary["hf"], summary["agreement"]
    return [
        [
            "gsm8k",
            "exact_match",
            f"{summary['pdserve']['exact_match']:.3f}",
            "-" if hf is None else f"{hf['exact_match']:.3f}",
            "-" if agree is None else f"{agree:.1%}",
            "-",
        ]
    ]
