"""The scheduler's decision for one forward, as plain host data (vLLM's seam: the scheduler decides,
the runner writes device memory). common/engine/batch.py turns it into a BatchPlan and a ForwardBatch.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pdserve.common.types import Req


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # prefill: each request adds one or more tokens after its cached prefix
    DECODE = "decode"  # each request adds exactly one token


@dataclass
class RowWrite:
    """req_to_token[row, start : start + len(slots)] = slots: the KV a request has before its first
    forward here (a prefix-cache hit, or pages a decode server reserved for a transfer)."""

    row: int
    start: int
    slots: list[int]


@dataclass
class AfterStep:
    """A verify step's request whose previous step is still in flight (speculation.py): the step keeps 0 to
    len(drafts) of its drafts, so this one's positions move by that many on the device."""

    slot: int  # FutureMap slot of the token that step samples last
    drafts: list[int]  # that step's drafts ([] for a plain step: it moves nothing)
    guess: int  # the token this step's drafts assume that step samples after all its drafts; -1: no drafts
    known: int  # len(req.output_ids) when this step was scheduled


@dataclass
class ScheduleBatch:
    """One forward as the scheduler decided it. Request i computes positions [starts[i], ends[i])."""

    mode: ForwardMode
    reqs: list[Req]
    starts: list[int]
    ends: list[int]
    samples: list[bool]  # False for a mid-prompt chunk: its sampled token is discarded
    # Rows to fill before this forward, in the order they were decided (a row freed and handed out
    # again is written again later in the list, so the last write wins).
    row_writes: list[RowWrite] = field(default_factory=list)
    # Prompt logprobs to compute (extend only): (request index, first position, end position); the
    # logits at position p score prompt token p + 1.
    prompt_logprobs: list[tuple[int, int, int]] = field(default_factory=list)
    # A verify step (speculative decoding, common/scheduling/speculation.py): request i's drafts, computed
    # after its last token at positions [starts[i] + 1, ends[i]) (EXTEND mode); every position samples.
    # None for any other batch.
    drafts: list[list[int]] | None = None
    # An overlapped verify step (speculation.py): per request, its step still in flight, or None.
    after: list[AfterStep | None] | None = None
    seq: int = 0  # launch order, set when launched (for traces and tests)

    @property
    def batch_size(self) -> int:
        return len(self.reqs)
