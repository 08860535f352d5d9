"""The overlapped verify step, device side: a verify step scheduled while each of its requests' previous
step still runs (docs/architecture.md, "Speculative decoding"; the scheduling side is
common/scheduling/speculation.py).

What the host does not know when it schedules step N+1, and where the device finds it:

    step N's last token (its bonus)      FutureMap.buf[slot]     the input id -slot, as a plain step's
    how many of N's drafts it kept (a)   FutureMap.counts[slot]  step N+1's positions, KV slots and
                                                                 lengths move by a (`resolve`)
    whether N+1's drafts still hold      a == len(N's drafts) and the bonus == the guess they continue

The host schedules N+1 as if N kept none of its drafts (seq_len counts a step in flight as one token),
and proposes N+1's drafts as if N kept all of them and then sampled the proposer's guess; when that
guess is wrong the drafts are dropped on the device (the request's rows still run: its first position
is its next token, exactly a plain step's). Every verify step stores, per request, its bonus token and
its accepted count in its FutureMap slots (`store`); a plain step's store writes count 0. A sampled
row's noise key depends on its step, which moves too: made again on the device (`move_noise`).

NOTE req_to_token must map every position the step may write: the builder writes the rows of positions
[ends[i], ends[i] + len(N's drafts)) too (`range_writes`), and the scheduler holds their pages.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pdserve.common.engine.sampling import step_key
from pdserve.common.engine.speculative.verify import accepted_lengths


@dataclass
class VerifySpec:
    """A verify step's per-request device data (one upload): B requests, K drafts at most, T tokens."""

    after: torch.Tensor  # [B] FutureMap slot of the request's step in flight (0: none)
    expect: torch.Tensor  # [B] that step's draft count: it must keep them all for this step's drafts to hold
    guess: torch.Tensor  # [B] the token this step's drafts assume it sampled after them (-1: always hold)
    num_drafts: torch.Tensor  # [B] this step's drafts per request (zeroed where the guess fails)
    rows: torch.Tensor  # [B, K + 1] the flat sampled row of each position (padded with the last)
    drafts: torch.Tensor  # [B, K] padded with -1
    token_req: torch.Tensor  # [T] the request of each token
    moves: bool  # some request's positions depend on a count still on the device
    delta: torch.Tensor | None = None  # [B] how far each request's positions moved (set by `resolve`)

    @staticmethod
    def plan(batch, extend_starts: list[int]) -> np.ndarray:
        """The upload of a verify ScheduleBatch (host): after, expect, guess, num_drafts, rows, drafts, token_req."""
        drafts, b = batch.drafts, batch.batch_size
        afters = batch.after or [None] * b
        k = max(len(d) for d in drafts)
        num = [len(d) for d in drafts]
        per_req = [
            [a.slot if a else 0 for a in afters],
            [len(a.drafts) if a else 0 for a in afters],
            [a.guess if a else -1 for a in afters],
            num,
        ]
        rows = [[s + min(j, n) for j in range(k + 1)] for s, n in zip(extend_starts, num)]
        padded = [d + [-1] * (k - len(d)) for d in drafts]
        token_req = np.repeat(np.arange(b, dtype=np.int64), [n + 1 for n in num])
        return np.concatenate(
            [np.asarray(per_req, dtype=np.int64).reshape(-1), np.asarray(rows, dtype=np.int64).reshape(-1)]
            + [np.asarray(padded, dtype=np.int64).reshape(-1), token_req]
        )

    @classmethod
    def views(cls, packed: torch.Tensor, b: int, num_tokens: int, moves: bool) -> VerifySpec:
        """The device views of `plan`'s upload."""
        k = (packed.numel() - 4 * b - b - num_tokens) // (2 * b)
        per_req, rest = packed[: 4 * b].view(4, b), packed[4 * b :]
        rows, rest = rest[: b * (k + 1)].view(b, k + 1), rest[b * (k + 1) :]
        drafts, token_req = rest[: b * k].view(b, k), rest[b * k :]
        return cls(per_req[0], per_req[1], per_req[2], per_req[3], rows, drafts, token_req, moves)


def moves(batch) -> bool:
    """Whether some request of a verify ScheduleBatch follows a verify step in flight that had drafts."""
    return batch.after is not None and any(a is not None and a.drafts for a in batch.after)


def range_writes(batch, page_size: int) -> np.ndarray | None:
    """[3, N] (rows, positions, slots) of the positions past ends[i] that request i writes if its step in
    flight kept drafts: [ends[i], ends[i] + len(its drafts))."""
    if batch.after is None:
        return None
    rows, positions, slots = [], [], []
    for req, end, after in zip(batch.reqs, batch.ends, batch.after):
        for p in range(end, end + (len(after.drafts) if after is not None else 0)):
            rows.append(req.req_pool_idx)
            positions.append(p)
            slots.append(req.pages[p // page_size] * page_size + p % page_size)
    return np.array([rows, positions, slots], dtype=np.int64) if slots else None


def resolve(batch, future_map, req_to_token: torch.Tensor, host_lens: bool) -> None:
    """On the forward stream, before the forward: what step N left on the device into batch N+1's inputs
    (in place in its upload, so a CUDA graph's copy of it sees them). `host_lens`: the attention backend
    reads the host's seq_lens, which are then read back (on a GPU, a sync: the torch-native backend)."""
    spec = batch.spec
    delta = spec.delta = future_map.counts[spec.after]
    held = (spec.guess < 0) | ((delta == spec.expect) & (future_map.buf[spec.after] == spec.guess))
    spec.num_drafts.mul_(held.to(torch.int64))
    if batch.has_placeholders:
        batch.input_ids.copy_(future_map.resolve(batch.input_ids))
        batch.has_placeholders = False
    if spec.moves:
        batch.positions.add_(delta[spec.token_req])
        rows = batch.req_pool_indices[spec.token_req]
        batch.out_cache_loc.copy_(req_to_token[rows, batch.positions])
        batch.seq_lens_dev.add_(delta)
        if host_lens:
            batch.seq_lens = batch.seq_lens_dev.tolist()


def move_noise(info, spec: VerifySpec) -> None:
    """On the forward stream, before sampling: the noise keys of sampled rows whose steps moved with their
    positions (a row samples its request's step num_sampled + j, counted as if the step before kept no
    drafts when the host built it), so each token is still the plain engine's draw at its step."""
    if spec.moves and info.seed_keys is not None:
        info.noise_keys = step_key(info.seed_keys, info.steps + spec.delta[spec.token_req][:, None])


def store(future_map, slots: list[int], next_token_ids: torch.Tensor, spec: VerifySpec) -> None:
    """After sampling: each request's accepted count and the token after its accepted drafts."""
    targets = next_token_ids[spec.rows]
    accepted = accepted_lengths(targets, spec.drafts, spec.num_drafts)
    future_map.store(slots, targets.gather(1, accepted[:, None]).squeeze(1), accepted)
