"""The host's share of structured output, without a model: B matchers of one JSON schema advanced
step by step, timing each step's token acceptance and mask filling.

    python -m pdserve.bench.grammar_fill --random-weights llama/1b --batch-size 128 --threads 1 2 4 8

What the overlap loop must finish within one forward (docs/architecture.md, "Structured outputs"):
N-1's tokens accepted, then N's masks filled. Each step every row takes a random allowed token
(what the argmax of a random-weight model does: with the widened vocabulary, mostly word pieces that
only a string allows), and both ways of spreading rows over threads are timed, taking turns step by step:
pdserve's shares (`Grammars`, one one-thread xgrammar batch matcher per thread) and xgrammar's own
`BatchGrammarMatcher(max_threads=t)`.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time

import numpy as np
import torch

from pdserve.bench.grammar_step import SCHEMAS


def main() -> None:
    from transformers import AutoTokenizer

    from pdserve.bench.random_weights import add_model_args, model_path_from_args
    from pdserve.common.engine.grammar import Grammars, bitmask_words

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(ap)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--schema", choices=sorted(SCHEMAS), nargs="+", default=sorted(SCHEMAS))
    ap.add_argument("--json", help="Also write the result here.")
    args = ap.parse_args()

    path = pathlib.Path(model_path_from_args(args))
    config = json.loads((path / "config.json").read_text())
    vocab = config["vocab_size"]
    tokenizer = AutoTokenizer.from_pretrained(path)
    eos = (tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0,)
    result = {"model": str(path), "vocab_size": vocab, "batch_size": args.batch_size, "steps": args.steps}
    print(f"vocab {vocab}, batch {args.batch_size}, {args.steps} steps; ms per step, median (p90)")
    for schema in args.schema:
        grammar = ("json_schema", json.dumps(SCHEMAS[schema]))
        ours = {t: Grammars(tokenizer, vocab, eos, threads=t) for t in args.threads}
        import xgrammar as xgr

        theirs = {t: xgr.BatchGrammarMatcher(max_threads=t) for t in args.threads}
        first = ours[args.threads[0]]
        first.compile(grammar).result()
        rows = [_Row(first.matcher(grammar)) for _ in range(args.batch_size)]
        samples = [True] * len(rows)
        index = list(range(len(rows)))
        bitmask = torch.full((len(rows), bitmask_words(vocab)), -1, dtype=torch.int32)
        times: dict[str, list[float]] = {}
        rng = np.random.default_rng(0)
        bits = torch.arange(32, dtype=torch.int32)
        # Each step times one way only, the first to touch the new states (a second fill of the
        # same states would find the grammar's tables in the CPU's caches, which the engine's
        # own work between steps evicts): the ways take turns.
        ways = [(kind, t) for t in args.threads for kind in ("shares", "xgrammar")]
        for step in range(args.steps):
            matchers = [r.grammar.matcher for r in rows]
            kind, t = ways[step % len(ways)]
            start = time.perf_counter()
            if kind == "shares":
                mask = ours[t].bitmask(rows, samples, launched=False).result()
            else:
                theirs[t].batch_fill_next_token_bitmask(matchers, bitmask, index)
                mask = bitmask
            times.setdefault(f"fill_{kind}_{t}", []).append(time.perf_counter() - start)
            allowed = ((mask.unsqueeze(-1) >> bits) & 1).view(len(rows), -1)[:, :vocab]
            logits = torch.from_numpy(rng.standard_normal((len(rows), vocab), dtype=np.float32))
            tokens = logits.masked_fill_(allowed == 0, float("-inf")).argmax(-1).tolist()
            t = args.threads[step % len(args.threads)]
            start = time.perf_counter()
            ours[t].accept_and_fill(rows, samples, tokens, [], []).result()  # (no masks after)
            times.setdefault(f"accept_shares_{t}", []).append(time.perf_counter() - start)
            for row, token in zip(rows, tokens):
                assert row.grammar.refused is None
                row.output_ids.append(token)
        result[schema] = {}
        for name, values in times.items():
            ms = sorted(v * 1e3 for v in values)
            result[schema][name] = {"median_ms": statistics.median(ms), "p90_ms": ms[int(0.9 * len(ms))]}
        print(f"  {schema}: " + ", ".join(f"{name} {r['median_ms']:.3f} ({r['p90_ms']:.3f})"
                                          for name, r in result[schema].items()))
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


class _Row:
    """What Grammars reads of a request."""

    def __init__(self, grammar):
        from pdserve.common.types import SamplingParams

        self.grammar, self.output_ids, self.pending, self.discard, self.finished = grammar, [], 0, 0, False
        self.params = SamplingParams(max_new_tokens=1 << 20)


if __name__ == "__main__":
    main()
