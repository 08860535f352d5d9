"""The engine side of a verify step (speculative decoding): the proposer the scheduler is given, the
batch's sampling rows and grammar masks, and its acceptance. The scheduling side (drafts, pages, what
the tokens do to the requests, the KV rollback) is common/scheduling/speculation.py; EngineCore
(common/engine/core.py) calls these.

A verify step samples every position of every request: request i's rows are `verify_rows(req, drafts)`
(its last token's and each draft's: k_i + 1), request after request, which is the order of the forward's
logits (ModelRunner.forward keeps every position's for a verify batch).
"""

from __future__ import annotations

import torch

from pdserve.common.config import EngineConfig
from pdserve.common.engine.overlap import h2d
from pdserve.common.engine.sampling import SamplingBatchInfo, noise_step, seed_key
from pdserve.common.engine.speculative.draft import DraftProposer
from pdserve.common.engine.speculative.ngram import NgramProposer
from pdserve.common.engine.speculative.verify import accepted_lengths, verify_rows
from pdserve.common.scheduling.batch import ScheduleBatch
from pdserve.common.scheduling.proposer import Proposer


def make_proposer(config: EngineConfig, runner) -> Proposer | None:
    """--speculative's proposer (config resolved: common/speculation.py refused what is not built), or None.
    `runner`: the target's ModelRunner (a draft model runs on its device, its pool as large as the target's)."""
    if config.speculative == "ngram":
        return NgramProposer(config.num_speculative_tokens, config.speculative_ngram_min, config.speculative_ngram_max)
    if config.speculative == "draft":
        return DraftProposer(config, runner.device, runner.kv_pool.capacity_pages)
    return None


def sampling_info(batch: ScheduleBatch, vocab_size: int, eos_token_ids: tuple[int, ...], device) -> SamplingBatchInfo:
    """The batch's sampling rows on the device: one per request, or a verify step's one per position."""
    if batch.drafts is None:
        return SamplingBatchInfo.from_reqs(batch.reqs, vocab_size, eos_token_ids, device)
    num_rows = len(batch.reqs) + sum(len(d) for d in batch.drafts)
    if all(req.params.plain_greedy for req in batch.reqs):
        return SamplingBatchInfo.plain_greedy(num_rows, vocab_size)  # (argmax: no row's tokens are read)
    rows = []
    for req, drafts in zip(batch.reqs, batch.drafts):
        rows += verify_rows(req, drafts)
    info = SamplingBatchInfo.from_reqs(rows, vocab_size, eos_token_ids, device)
    if batch.after is not None and info.noise_keys is not None:  # (its steps may move: overlap.py)
        info.seed_keys = h2d([[seed_key(r.seed)] for r in rows], torch.int64, device)
        info.steps = h2d([[noise_step(r)] for r in rows], torch.int64, device)
    return info


def row_owners(batch: ScheduleBatch) -> list:
    """The request of each sampled row (what to_token_logprobs reads: its params)."""
    if batch.drafts is None:
        return batch.reqs
    return [req for req, drafts in zip(batch.reqs, batch.drafts) for _ in range(len(drafts) + 1)]


def row_masks(mask: torch.Tensor | None, batch: ScheduleBatch) -> torch.Tensor | None:
    """Grammar masks [B, words] (host) as the batch's rows. A grammar request has no drafts (one row);
    a row without a grammar allows everything, whichever position of its request it samples."""
    if mask is None or batch.drafts is None:
        return mask
    # NOTE a new host tensor, not the pinned slot Grammars filled: its copy to the device is synchronous.
    counts = torch.tensor([len(d) + 1 for d in batch.drafts])
    return torch.repeat_interleave(mask, counts, dim=0)


def accepted_counts(next_token_ids: list[int], drafts: list[list[int]]) -> list[int]:
    """Drafts accepted per request: the longest prefix of each request's drafts equal to the samples
    at their positions (`next_token_ids`: a verify step's, one per position, request after request)."""
    k = max(len(d) for d in drafts)
    targets, padded, row = [], [], 0
    for d in drafts:
        n = len(d) + 1
        targets.append(next_token_ids[row : row + n] + [-1] * (k + 1 - n))
        padded.append(d + [-1] * (k - len(d)))
        row += n
    num_drafts = torch.tensor([len(d) for d in drafts])
    return accepted_lengths(torch.tensor(targets), torch.tensor(padded).reshape(len(drafts), k), num_drafts).tolist()
