"""Prompt logprobs: how likely each prompt token was given the tokens before it.

Computed inside a prefill forward, for the requests that asked (SamplingParams.prompt_logprobs),
from the hidden states of every position they score (BatchPlan.prompt_logprobs); everyone else's
prefill still computes logits for its last position only. The LM head runs over blocks of rows so
a long prompt never holds [tokens, vocab] fp32 logits at once. With tensor parallelism every rank
runs the same blocks (the LM head all-gathers); rank 0 keeps the result.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK_ROWS = 1024  # rows of logits at a time: 1024 x 128k vocab in fp32 is 512 MiB


@dataclass
class PromptLogprobs:
    """Per scored position (the batch's order): the scored token's logprob and rank, and the top n."""

    logprobs: torch.Tensor  # [M] float32
    ranks: torch.Tensor  # [M] int64: 1 + how many tokens scored higher
    top_ids: torch.Tensor | None  # [M, n] int64, n = the batch's largest top-n (None when 0)
    top_logprobs: torch.Tensor | None  # [M, n] float32, descending

    def to_host(self) -> "PromptLogprobs":
        """Copies on the current stream into pinned host memory (on CUDA); read after it syncs."""

        def host(t):
            return None if t is None else t.to("cpu", non_blocking=True)

        return PromptLogprobs(host(self.logprobs), host(self.ranks), host(self.top_ids), host(self.top_logprobs))


def score_prompt(model, hidden: torch.Tensor, index: torch.Tensor, targets: torch.Tensor, top_n: int) -> PromptLogprobs:
    """Log-softmax of the logits at `hidden[index]`, at `targets` (and the top `top_n`), in fp32."""
    logprobs, ranks, top_ids, top_lps = [], [], [], []
    for start in range(0, index.numel(), BLOCK_ROWS):
        rows = index[start : start + BLOCK_ROWS]
        scored = targets[start : start + BLOCK_ROWS, None]
        lp = torch.log_softmax(model.compute_logits(hidden[rows]).float(), dim=-1)
        picked = lp.gather(1, scored)
        logprobs.append(picked.squeeze(1))
        ranks.append((lp > picked).sum(dim=1) + 1)
        if top_n:
            values, ids = lp.topk(top_n, dim=-1)
            top_lps.append(values)
            top_ids.append(ids)
    return PromptLogprobs(
        torch.cat(logprobs),
        torch.cat(ranks),
        torch.cat(top_ids) if top_n else None,
        torch.cat(top_lps) if top_n else None,
    )
