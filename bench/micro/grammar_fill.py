"""The host's share of structured output, without a model: B matchers of one JSON schema advanced
step by step, timing each step's token acceptance and mask filling.

    python -m pdserve.bench.micro.grammar_fill --random-weights llama/1b --batch-size 128 --threads 1 2 4 8

What the overlap loop must finish within one forward (docs/architecture.md, "Structured outputs"):
N-1's tokens accepted, then N's masks filled. Each step every row takes a random allowed token
(what the argmax of a random-weight model does: with the widened vocabulary, mostly word pieces that
only a string allows), and two ways are timed, taking turns step by step: pdserve's (`Grammars`: the
grammar worker process accepts the step's tokens and fills the next masks in shares, one one-thread
xgrammar batch matcher per thread; timed from the loop's side, the round trip included) and
xgrammar's own `BatchGrammarMatcher(max_threads=t)` filling in this process.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time

import numpy as np
import torch

from pdserve.bench.micro.grammar_step import SCHEMAS
from pdserve.common.list_flag import ListFlag


def main() -> None:
    from transformers import AutoTokenizer

    from pdserve.bench.random_weights import add_model_args, model_path_from_args
    from pdserve.common.engine.grammar import Grammars, bitmask_words

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(ap)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--threads", type=int, nargs="+", action=ListFlag, default=[1, 2, 4, 8])
    ap.add_argument("--schema", choices=sorted(SCHEMAS), nargs="+", action=ListFlag, default=sorted(SCHEMAS))
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
        compiled = first.compile(grammar).result()
        rows = {t: [_Row(g.matcher(grammar)) for _ in range(args.batch_size)] for t, g in ours.items()}
        matchers = [xgr.GrammarMatcher(compiled) for _ in range(args.batch_size)]  # xgrammar's own, in step
        samples = [True] * args.batch_size
        index = list(range(args.batch_size))
        bitmask = torch.full((args.batch_size, bitmask_words(vocab)), -1, dtype=torch.int32)
        times: dict[str, list[float]] = {}
        rng = np.random.default_rng(0)
        bits = torch.arange(32, dtype=torch.int32)
        masks = {t: g.bitmask(rows[t], samples, launched=False).result() for t, g in ours.items()}
        # Each step times one way only (the ways take turns, so drift hits all alike); every way
        # walks the same tokens.
        ways = [(kind, t) for t in args.threads for kind in ("shares", "xgrammar")]
        for step in range(args.steps):
            kind, t = ways[step % len(ways)]
            start = time.perf_counter()
            theirs[t].batch_fill_next_token_bitmask(matchers, bitmask, index)
            if kind == "xgrammar":
                times.setdefault(f"fill_xgrammar_{t}", []).append(time.perf_counter() - start)
            allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).view(args.batch_size, -1)[:, :vocab]
            logits = torch.from_numpy(rng.standard_normal((args.batch_size, vocab), dtype=np.float32))
            tokens = logits.masked_fill_(allowed == 0, float("-inf")).argmax(-1).tolist()
            assert all(xgr.BatchGrammarMatcher.batch_accept_token(matchers, tokens))
            for u, g in ours.items():
                for row in rows[u]:
                    row.pending = 2  # these tokens and the next step's in flight, as in the loop
                start = time.perf_counter()
                masks[u] = g.accept_and_fill(rows[u], samples, tokens, rows[u], samples).result()
                if kind == "shares" and u == t:
                    times.setdefault(f"accept_fill_worker_{t}", []).append(time.perf_counter() - start)
                for row, token in zip(rows[u], tokens):
                    assert row.grammar.refused is None
                    row.pending = 0
                    row.output_ids.append(token)
        result[schema] = {}
        for name, values in times.items():
            ms = sorted(v * 1e3 for v in values)
            result[schema][name] = {"median_ms": statistics.median(ms), "p90_ms": ms[int(0.9 * len(ms))]}
        print(
            f"  {schema}: "
            + ", ".join(f"{name} {r['median_ms']:.3f} ({r['p90_ms']:.3f})" for name, r in result[schema].items())
        )
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


class _Row:
    """What Grammars reads of a request."""

    def __init__(self, grammar):
        from pdserve.common.types import SamplingParams

        self.grammar, self.output_ids, self.pending, self.discard, self.finished = grammar, [], 0, 0, False
        self.params, self.rid = SamplingParams(max_new_tokens=1 << 20), "row"


if __name__ == "__main__":
    main()
