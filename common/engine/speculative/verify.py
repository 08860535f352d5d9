"""Exact verification of drafts: the target model's forward over a request's last token and its k
drafts gives k + 1 rows of logits; row j is sampled as the plain engine samples the request's step
`num_sampled + j` with drafts[:j] as output tokens (penalties, min_new_tokens and the noise key all
see that step: common/engine/sampling.py); drafts are accepted while they equal those samples, and
the first sample that differs (or the one after the last draft) is the bonus token.

Why exact, for every temperature: the plain engine's token at a step is a function of the sequence
so far and the row's noise key (seed, step) — the exponential race `argmax(p / q)` with counter-based
noise. Row j's sequence is the request's plus drafts[:j], which is the true sequence exactly while
every earlier draft was accepted; so each token returned here is the token the plain engine would
have drawn at that step, seed for seed (not only in distribution, as rejection sampling keeps it).
For a one-hot draft (n-gram) a draft is accepted with probability p(draft), as with rejection
sampling; a draft model that draws with the same noise is coupled to the target the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.common.types import SamplingParams


@dataclass
class AtStep:
    """What SamplingBatchInfo reads of a request (params, seed, step, tokens), at one draft position."""

    params: SamplingParams
    seed: int
    num_sampled: int
    prompt_ids: list[int]
    output_ids: list[int]


def verify_rows(req, drafts: list[int]) -> list[AtStep]:
    """The k + 1 sampling rows of `req` verifying `drafts`. With a step in flight (an overlapped verify
    step) the rows' steps are the ones if that step keeps no drafts, moved on the device, and the tokens
    are not all here: only a request whose sampling reads neither (SamplingParams.reads_step_only)."""
    if req.pending and not req.params.reads_step_only:
        raise ValueError("verify rows need the request's tokens: none may be pending")
    step = req.num_sampled
    return [
        AtStep(req.params, req.seed, step + j, req.prompt_ids, req.output_ids + drafts[:j])
        for j in range(len(drafts) + 1)
    ]


def accepted_lengths(targets: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor) -> torch.Tensor:
    """Drafts accepted per request [B]: the length of the longest prefix of drafts [B, K] (padded past
    num_drafts [B]) equal to the target's samples targets [B, K + 1] at the same positions. On the
    device, no sync: request b's new tokens are targets[b, : accepted[b] + 1]."""
    k = drafts.shape[1]
    match = targets[:, :k] == drafts
    match &= torch.arange(k, device=drafts.device) < num_drafts[:, None]
    return match.to(torch.int64).cumprod(dim=1).sum(dim=1)
