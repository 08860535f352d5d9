"""What one forward pass runs, on both sides of vLLM's seam.

    ScheduleBatch   the scheduler's decision, plain host data (common/scheduling/batch.py): which
                    requests, which positions, which req_to_token rows to fill first. The scheduler
                    never touches the device.
    BatchPlan       the runner side's host half of it: the one upload's values and the host-side
                    lengths, with no request state (what a TP server's other ranks receive).
    ForwardBatch    device tensors plus the host-side lengths, built from a BatchPlan by the
                    BatchBuilder (common/engine/batch_builder.py) on the schedule stream; the model
                    runner and the attention backend only read it.

Tokens of all requests are laid out flat, request after request, with no padding: request i owns
tokens [extend_starts[i], extend_starts[i] + extend_lens[i]).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pdserve.common.scheduling.batch import ForwardMode
from pdserve.common.types import Req


@dataclass
class BatchPlan:
    """A ScheduleBatch reduced to what every TP rank's runner needs: no Req, no device tensor."""

    mode: ForwardMode
    # The batch's one upload. Decode: [6, B] (input ids, positions, out slots, req rows, seq lens,
    # last indices); extend: [4T + 3B] (input ids, positions, out slots, token rows | req rows,
    # last indices, seq lens).
    packed: np.ndarray
    num_tokens: int
    seq_lens: list[int]
    extend_lens: list[int]
    extend_starts: list[int]
    req_rows: list[int]
    samples: list[bool]
    has_placeholders: bool
    row_writes: np.ndarray | None  # [3, N] int64 (rows, positions, slots) to write first, or None
    seq: int = 0
    # Prompt logprobs: [2, M] int64 (flat token index whose logits score, the prompt token they
    # score) and the largest top-n asked for; None when no request of the batch asked.
    prompt_logprobs: np.ndarray | None = None
    prompt_top_n: int = 0
    verify: bool = False  # a verify step (speculative decoding): every position's logits are kept
    # A verify step's per-request upload (common/engine/speculative/overlap.py VerifySpec.plan), and whether
    # its positions move by counts still on the device.
    verify_spec: np.ndarray | None = None
    verify_moves: bool = False


@dataclass
class ForwardBatch:
    mode: ForwardMode
    reqs: list[Req]
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    out_cache_loc: torch.Tensor  # [T] int64: the KV slot each new token is written to
    req_pool_indices: torch.Tensor  # [B] int64: ReqToTokenPool rows
    # Host-side copies, known at scheduling time, so no backend ever reads lengths back from the device.
    seq_lens: list[int]  # KV length of each request after this forward (prefix + extend)
    extend_lens: list[int]  # new tokens of each request in this forward
    extend_starts: list[int]  # offset of each request's first new token in the flat layout
    req_rows: list[int]  # ReqToTokenPool rows, host copy
    last_indices: torch.Tensor  # [B] int64: flat index of each request's last new token
    samples: list[bool]  # False for a mid-prompt chunk: its sampled token is discarded
    has_placeholders: bool  # some input id is a FutureMap placeholder (< 0)
    seq_lens_dev: torch.Tensor | None = None  # [B] int64: seq_lens on the device
    # The upload the device fields are rows of, for a CUDA-graph runner's one copy. Decode: [6, B]
    # int64 (input_ids, positions, out_cache_loc, req_pool_indices, seq_lens, last_indices);
    # extend: [3, T] int64 (input_ids, positions, out_cache_loc).
    packed: torch.Tensor | None = None
    seq: int = 0  # its ScheduleBatch's launch order (for traces and tests)
    # Prompt logprobs (see BatchPlan): the flat token indices and the tokens they score, on the
    # device, and the top-n; None when no request of the batch asked (no CUDA graph runs it then).
    prompt_logprob_index: torch.Tensor | None = None
    prompt_logprob_targets: torch.Tensor | None = None
    prompt_top_n: int = 0
    plan: BatchPlan | None = None  # what it was built from (a TP server sends it to its other ranks)
    # A verify step (speculative decoding: a request's last token and its drafts): the forward returns
    # the logits of every position [T, vocab], not only each request's last, and runs eagerly.
    verify: bool = False
    spec: object = None  # a verify step's VerifySpec (common/engine/speculative/overlap.py)

    @property
    def batch_size(self) -> int:
        return len(self.req_rows)  # a TP rank other than 0 has no reqs

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    def last_token_indices(self) -> list[int]:
        """Flat index of each request's last new token: where its next-token logits come from."""
        return [s + n - 1 for s, n in zip(self.extend_starts, self.extend_lens)]
