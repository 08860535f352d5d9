"""`pdserve bench spec-replay`: what n-gram speculation (prompt lookup) would accept on a workload,
replayed from the plain engine's greedy answers.

    pdserve bench spec-replay --model-path DIR [--workload copy|random] [--num-prompts 32]
        [--output-len 128] [--num-speculative-tokens 1 2 4 8] [--min-n 1] [--max-n 4]

Why a replay is exact: greedy verification accepts a draft while it equals the target's argmax, so
a speculative engine's answer is the plain engine's answer, and the drafts it would propose at each
verify step (a function of the tokens so far: common/engine/speculative/ngram.py) and how many of
them match are fixed by that answer. Replaying the answer step by step — propose k drafts, accept
the longest prefix equal to the answer's next tokens, take one more token (the target's own) —
gives the verify steps a speculative decode would run, without running one. It says which k pays
on a workload before the device is asked (verify cost per k: docs/benchmarks/README.md).

`--workload copy` is bench/micro/copy_workload.py's edit/rewrite/quote requests through the chat template;
`random` is random token ids (speculation's floor).
"""

from __future__ import annotations

import argparse
import json
import statistics

from pdserve.common.engine.speculative.ngram import NgramIndex
from pdserve.common.list_flag import ListFlag


def replay(prompt: list[int], answer: list[int], k: int, min_n: int = 1, max_n: int = 4) -> tuple[int, int, int]:
    """(verify steps, drafts proposed, drafts accepted) for `answer` after `prompt` with k drafts a
    step. Each step adds its accepted drafts and one token of the target's; the answer's last
    token ends the replay (no draft is proposed past the answer's length)."""
    index = NgramIndex(min_n, max_n)
    index.extend(prompt)
    steps = proposed = accepted = 0
    done = 0
    while done < len(answer):
        drafts = index.propose(min(k, len(answer) - done - 1))
        n = 0
        while n < len(drafts) and drafts[n] == answer[done + n]:
            n += 1
        new = answer[done : done + n + 1]
        index.extend(new)
        done += len(new)
        steps += 1
        proposed += len(drafts)
        accepted += n
    return steps, proposed, accepted


def add_parser(kinds) -> None:
    parser = kinds.add_parser(
        "spec-replay",
        help="What n-gram speculation would accept on a workload, replayed from greedy answers.",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument("--model-path", required=True, help="Checkpoint directory or GGUF file.")
    parser.add_argument("--workload", choices=("copy", "random"), default="copy")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=256, help="--workload random: prompt tokens.")
    parser.add_argument("--output-len", type=int, default=128, help="Most tokens of each answer (greedy).")
    parser.add_argument("--num-speculative-tokens", type=int, nargs="+", action=ListFlag, default=[1, 2, 4, 8])
    parser.add_argument("--min-n", type=int, default=1)
    parser.add_argument("--max-n", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pdserve.bench.micro.copy_workload import copy_prompts
    from pdserve.bench.workload import random_prompts, token_pool
    from pdserve.common.engine.engine import Engine
    from pdserve.common.types import SamplingParams

    if any(k < 1 for k in args.num_speculative_tokens) or not 1 <= args.min_n <= args.max_n:
        raise SystemExit("error: --num-speculative-tokens must be >= 1, and 1 <= --min-n <= --max-n")
    engine = Engine(model_path=args.model_path, device=args.device, dtype=args.dtype)
    try:
        if args.workload == "copy":
            prompts = copy_prompts(engine.tokenizer, args.num_prompts, args.seed)
        else:
            pool = token_pool(args.model_path)
            prompts = random_prompts(pool, args.num_prompts, args.input_len, args.seed, run=0)
        greedy = SamplingParams(max_new_tokens=args.output_len, temperature=0)  # (the default samples at 1.0)
        answers = [c.output_ids for c in engine.generate(prompts, greedy)]
    finally:
        engine.close()
    rows = []
    for k in args.num_speculative_tokens:
        per = [replay(p, a, k, args.min_n, args.max_n) for p, a in zip(prompts, answers) if a]
        steps, proposed, accepted = (sum(x[i] for x in per) for i in range(3))
        tokens = sum(len(a) for a in answers)
        rows.append(
            {
                "k": k,
                "tokens_per_step": tokens / steps,
                "acceptance": accepted / proposed if proposed else 0.0,
                "proposed_per_step": proposed / steps,
                "steps": steps,
                "plain_steps": tokens,
            }
        )
    print(f"{args.workload} workload, {len(prompts)} prompts, {sum(len(a) for a in answers)} greedy answer tokens")
    print(" k | tokens / verify step | drafts accepted | drafts / step | verify steps (plain)")
    for r in rows:
        print(
            f"{r['k']:>2} | {r['tokens_per_step']:>20.2f} | {r['acceptance']:>14.1%} | {r['proposed_per_step']:>13.2f} "
            f"| {r['steps']} ({r['plain_steps']})"
        )
    report = {"bench": "spec-replay", "workload": args.workload, "rows": rows}
    print(json.dumps(report | {"median_prompt_len": statistics.median(len(p) for p in prompts)}))
    return 0
