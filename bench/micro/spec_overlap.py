"""`pdserve bench spec-overlap`: what the verify loop itself costs, serial against overlapped verify steps
(`--speculative-overlap off | on | auto`), on drafts whose acceptance the bench sets.

    pdserve bench spec-overlap (--model-path DIR | --random-weights ARCH/SHAPE) [--batch-size 1 8]
        [--prompt-len 200] [--output-len 256] [--wrong-every 0 3] [--seed 0] [--output-json FILE]
        [engine flags: --num-speculative-tokens K, --dtype float32 ...]

For each --batch-size B, one engine with --speculative ngram whose proposer is replaced by the answers'
(`AnswerProposer`): B random prompts are answered greedily with no drafts (the plain decode steps: the
baseline, and the answers), then, for each --wrong-every N, with drafts taken from those answers with
every N-th one made wrong (0: all right), in each overlap mode. Each run is timed after an untimed one
of the same requests (its warm-up; `auto` learns there whether to overlap); ms per token = the timed
run's time / its tokens. The answers must equal the plain ones (float32: the bench raises at a
difference; in bf16 a near-tie may go the other way and the oracle's drafts then stop being accepted,
so use --dtype float32 with random weights). The proposer stands in for one that proposes exactly
what the model will say: acceptance is set, not measured — `bench spec-itl` measures a real proposer's.

With `--speculative draft --draft-model-path DIR` the engine's draft model drafts instead (one row per
B, --wrong-every unused): the plain baseline is still timed with a proposer that drafts nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import time

from pdserve.bench.micro.spec_itl import SPEC_COUNTERS, check_exact, release_engine_memory
from pdserve.common.list_flag import ListFlag
from pdserve.common.scheduling.proposer import Proposer

MODES = ("off", "on", "auto")


class AnswerProposer(Proposer):
    """Drafts from the answers the plain steps gave (keyed by prompt), every `wrong_every`-th one wrong
    (0: none), the wrong ones fixed by (prompt, position); with `k` 0 none at all (plain decode steps).
    Drafts after a step in flight too (`propose_after`: its first token a guess of that step's last)."""

    hypothesizes = True

    def __init__(self, answers: dict[tuple[int, ...], list[int]], k: int, wrong_every: int, vocab_size: int):
        self.answers, self.k, self.wrong_every, self.vocab_size = answers, k, wrong_every, vocab_size

    def propose_for(self, req, limit: int) -> list[int]:
        return self._answer(req, len(req.output_ids), min(self.k, limit))

    def propose_after(self, req, extra: list[int], limit: int) -> list[int]:
        return self._answer(req, len(req.output_ids) + len(extra), min(self.k + 1, limit) if self.k else 0)

    def _answer(self, req, done: int, n: int) -> list[int]:
        drafts = self.answers.get(tuple(req.prompt_ids), [])[done : done + n]
        every = self.wrong_every
        wrong = [every and (done + j) * 7 % every == len(req.prompt_ids) % every for j in range(len(drafts))]
        return [(t + 1) % self.vocab_size if w else t for t, w in zip(drafts, wrong)]


def add_parser(kinds) -> None:
    from pdserve.bench.random_weights import add_model_args
    from pdserve.common.config import EngineConfig, add_cli_args

    parser = kinds.add_parser(
        "spec-overlap",
        help="The verify loop's cost: serial against overlapped verify steps, on drafts of set acceptance.",
        description=__doc__.split("\n\n")[0],
    )
    add_model_args(parser, model_path_flag=False)
    parser.add_argument(
        "--batch-size", type=int, nargs="+", action=ListFlag, default=[1, 8], help="Requests at once (each B)."
    )
    parser.add_argument("--prompt-len", type=int, default=200, help="Tokens of each random prompt.")
    parser.add_argument("--output-len", type=int, default=256, help="Tokens of each answer (ignore_eos).")
    parser.add_argument(
        "--wrong-every",
        type=int,
        nargs="+",
        action=ListFlag,
        default=[0, 3],
        help="Every N-th draft wrong (0: all right).",
    )
    parser.add_argument("--seed", type=int, default=0, help="Seed of the random prompts.")
    parser.add_argument("--output-json", default=None, metavar="FILE", help="Also write the JSON report here.")
    add_cli_args(parser, EngineConfig)
    parser.set_defaults(func=run)


def timed(engine, prompts, params) -> tuple[list[list[int]], float, dict[str, int]]:
    """An untimed run, then a timed one: its answers, seconds and speculation counters."""
    import torch

    engine.generate(prompts, params)
    before = dict(engine.scheduler.stats)
    cuda = engine.runner.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(engine.runner.device)
    start = time.perf_counter()
    out = engine.generate(prompts, params)
    if cuda:
        torch.cuda.synchronize(engine.runner.device)
    seconds = time.perf_counter() - start
    counters = {k: engine.scheduler.stats.get(k, 0) - before.get(k, 0) for k in SPEC_COUNTERS}
    return [c.output_ids for c in out], seconds, counters


def run_batch_size(config, batch: int, args, strict: bool) -> list[dict]:
    from pdserve.common.engine.engine import Engine
    from pdserve.common.types import SamplingParams

    rng = random.Random(args.seed + batch)
    params = SamplingParams(max_new_tokens=args.output_len, temperature=0, ignore_eos=True)
    # (a draft model's pool holds every row a verify step may have at full context: no more rows than B)
    running = batch if config.speculative == "draft" else max(batch, config.max_running_requests)
    engine = Engine(dataclasses.replace(config, max_running_requests=running))
    try:
        vocab = engine.vocab_size
        prompts = [[rng.randrange(1, vocab) for _ in range(args.prompt_len)] for _ in range(batch)]
        spec = engine.scheduler.speculation
        draft_model = spec.proposer if config.speculative == "draft" else None
        spec.proposer, spec.policy.overlap = AnswerProposer({}, 0, 0, vocab), "on"
        plain, plain_s, _ = timed(engine, prompts, params)
        tokens = sum(len(a) for a in plain)
        answers = {tuple(p): a for p, a in zip(prompts, plain)}
        rows = []
        for every in [None] if draft_model is not None else args.wrong_every:
            row = {
                "batch_size": batch,
                "wrong_every": every,  # (None: the draft model's drafts)
                "tokens": tokens,
                "plain_ms_per_token": 1e3 * plain_s / tokens,
            }
            for mode in MODES:
                spec.proposer = draft_model or AnswerProposer(answers, config.num_speculative_tokens, every, vocab)
                spec.policy.overlap, spec.policy.held = mode, 0.0
                out, seconds, counters = timed(engine, prompts, params)
                row[f"{mode}_answers_differing"] = check_exact(plain, out, strict)
                row[f"{mode}_ms_per_token"] = 1e3 * seconds / tokens
                row[f"{mode}_speedup"] = plain_s / seconds
                row[f"{mode}_counters"] = counters
            rows.append(row)
        if not engine.is_idle():
            raise RuntimeError(f"the engine is not idle after the runs: {engine.stats()}")
        return rows
    finally:
        engine.close()
        del engine
        release_engine_memory()


def drafts_label(wrong_every: int | None) -> str:
    if wrong_every is None:
        return "draft model"
    return f"every {wrong_every}-th wrong" if wrong_every else "all right"


def run(args: argparse.Namespace) -> int:
    from pdserve.bench.random_weights import model_path_from_args
    from pdserve.bench.report import command_line, device_name, emit, table
    from pdserve.common.config import EngineConfig, from_cli_args

    if min(args.batch_size) < 1 or args.prompt_len < 1 or args.output_len < 2 or min(args.wrong_every) < 0:
        raise SystemExit("error: --batch-size, --prompt-len >= 1, --output-len >= 2, --wrong-every >= 0")
    model_path_from_args(args)
    config = from_cli_args(args, EngineConfig)
    speculative = "draft" if config.speculative == "draft" else "ngram"  # (ngram: its proposer replaced)
    config = dataclasses.replace(config, speculative=speculative, speculative_max_batch=0)
    resolved = config.resolve()  # (refuses bad flags before any engine)
    rows = []
    for batch in args.batch_size:
        rows += run_batch_size(config, batch, args, strict=resolved.dtype == "float32")
    print(
        f"spec-overlap: k {resolved.num_speculative_tokens}, {args.prompt_len}-token random prompts, "
        f"{args.output_len} tokens each, greedy; ms per token (x: against plain decode steps)"
    )
    header = ["B", "drafts", "plain"] + [f"{m}" for m in MODES] + ["verify steps off / on / auto"]
    print(
        table(
            header,
            [
                [r["batch_size"], drafts_label(r["wrong_every"]), f"{r['plain_ms_per_token']:.3f}"]
                + [f"{r[f'{m}_ms_per_token']:.3f} ({r[f'{m}_speedup']:.2f}x)" for m in MODES]
                + [" / ".join(str(r[f"{m}_counters"]["spec_verify_steps"]) for m in MODES)]
                for r in rows
            ],
        )
    )
    report = {
        "bench": "spec-overlap",
        "num_speculative_tokens": resolved.num_speculative_tokens,
        "model": resolved.model_path,
        "device": device_name(resolved.device),
        "dtype": resolved.dtype,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "rows": rows,
        "command": command_line(args.argv),
    }
    emit(report, args.output_json)
    return 0
