"""CUDA graphs for small prefills: one captured forward per padded token count.

A prefill of one short prompt is 100-150 kernels, and launching them one by one from Python takes
the host longer than the device takes to run them (measured on an H200, one 256-token prompt,
`generate` wall time against summed kernel time: GPT-2 4.0 ms / 0.49 ms, Llama-1B 6-10 ms /
1.45 ms). That host time is most of a request's time to first token at low load. A graph launches
them all at once. What a graph captures, from static input buffers to a static logits buffer:

    input ids -> model -> hidden states of each request's last token -> logits [R + 1, vocab] (R below)

A batch of n tokens over b requests replays the smallest captured token count T >= n, if b <=
max_reqs. The kernels' grids are fixed at capture, sized for T tokens over the graph's R + 1 request
slots, R = min(T, max_reqs) (a batch of T tokens holds at most T requests: a small graph's attention
grid stays small):

    tokens n..T-1     id 0 at position 0, KV written to slot 0 (reserved, never handed out),
                      owned by one padding request in the last slot R: row `pad_row` (all slot 0),
                      so their attention reads only slot 0 and every padded row stays finite.
                      Rows are never mixed (norms, GEMMs, attention are per row or per request),
                      and padded rows are never gathered for logits.
    requests b..R-1   extend_len 0 (every attention program of theirs returns at once), row
                      `pad_row`, last index 0 (a real row; their logits are sliced off).

Sampling stays outside, as for decode graphs (cuda_graph.py), and so do its lifetimes: the static
buffers are written on the forward stream just before the replay, and the logits are valid until
the next replay is queued. Prefill and decode graphs share one memory pool (never replayed at once).

With `capture=False` the runner runs the same padded forward eagerly: how the CPU tests check the
padding against the unpadded path (graph capture itself needs a GPU).

A runner with `keep_all` (speculative decoding's verify steps: common/engine/speculative/verify_graph.py)
captures the logits of every position, [T, vocab] (the padded rows' sliced off), and takes only verify
batches; the others take none.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from pdserve.common.engine.batch import ForwardBatch
from pdserve.common.engine.cuda_graph import capture_graph
from pdserve.common.engine.overlap import h2d_array
from pdserve.common.scheduling.batch import ForwardMode

logger = logging.getLogger(__name__)

MAX_PREFILL_GRAPH_REQS = 16  # a low-load prefill batch holds a few requests; more run eagerly


def prefill_capture_sizes(max_tokens: int) -> list[int]:
    """Token counts to capture: 16, 32, ..., 128, then four steps per doubling (160, 192, 224,
    256, 320, ...), so padding adds at most a quarter; and max_tokens (a multiple of 16)."""
    sizes, size = [], 16
    while size < max_tokens:
        sizes.append(size)
        size += max(16, (1 << (size.bit_length() - 1)) // 4)
    return sizes + [max_tokens]


class PrefillGraphRunner:
    keep_all = False  # every position's logits (verify steps), not each request's last

    def __init__(
        self, runner, max_tokens: int, max_reqs: int = MAX_PREFILL_GRAPH_REQS, pool=None, capture: bool = True
    ):
        self.runner = runner
        self.max_reqs = max_reqs
        self.sizes = self.capture_sizes(max_tokens)
        device = runner.device
        self.pad_row = runner.req_to_token_pool.pad_row
        # Static inputs. Per token: input_ids, positions, out_cache_loc (the rows of an extend
        # batch's upload, ForwardBatch.packed). Per request, int64: req_pool_indices, last_indices;
        # int32 (what the extend kernel reads): seq_lens, extend_lens, extend_starts.
        self.tokens = torch.zeros((3, self.sizes[-1]), dtype=torch.int64, device=device)
        # One slot more than max_reqs: the padding request (see the module docstring).
        self.per_req = torch.zeros((2, max_reqs + 1), dtype=torch.int64, device=device)
        self.lens = torch.zeros((3, max_reqs + 1), dtype=torch.int32, device=device)
        self.per_req[0].fill_(self.pad_row)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.captured = capture
        self.replays = 0
        if capture:
            self._capture_all(pool)

    def capture_sizes(self, max_tokens: int) -> list[int]:
        if max_tokens % 16:
            raise ValueError(f"prefill graphs need a token count that is a multiple of 16, got {max_tokens}")
        return prefill_capture_sizes(max_tokens)

    def num_slots(self, size: int) -> int:
        """Request slots of the graph of `size` tokens: the batch's (at most one per token), then the
        padding request's."""
        return min(size, self.max_reqs) + 1

    @property
    def max_tokens(self) -> int:
        return self.sizes[-1]

    def can_run(self, batch: ForwardBatch) -> bool:
        return (
            batch.mode is ForwardMode.EXTEND
            and batch.packed is not None
            and not batch.has_placeholders
            and batch.verify == self.keep_all
            and batch.num_tokens <= self.max_tokens
            and batch.batch_size <= self.max_reqs
        )

    def _static_batch(self, num_tokens: int) -> ForwardBatch:
        """The ForwardBatch the captured model sees: views of the static buffers (the host-side
        lists are placeholders; nothing on the graph path reads them)."""
        r = self.num_slots(num_tokens)
        return ForwardBatch(
            mode=ForwardMode.EXTEND,
            reqs=[],
            input_ids=self.tokens[0, :num_tokens],
            positions=self.tokens[1, :num_tokens],
            out_cache_loc=self.tokens[2, :num_tokens],
            req_pool_indices=self.per_req[0, :r],
            seq_lens=[0] * r,
            extend_lens=[0] * r,
            extend_starts=[0] * r,
            req_rows=[self.pad_row] * r,
            last_indices=self.per_req[1, :r],
            samples=[False] * r,
            has_placeholders=False,
            verify=self.keep_all,
        )

    def _run_model(self, num_tokens: int) -> torch.Tensor:
        r = self.runner
        batch = self._static_batch(num_tokens)
        seq_lens, extend_lens, extend_starts = self.lens[:, : batch.batch_size]
        r.attn.bind_extend(batch.req_pool_indices, seq_lens, extend_lens, extend_starts, num_tokens)
        hidden = r.model(batch.input_ids, batch.positions, batch, r.attn)
        return r.model.compute_logits(hidden if self.keep_all else hidden[batch.last_indices])

    @torch.inference_mode()
    def _capture_all(self, pool) -> None:
        stream = self.runner.streams.forward_stream
        free_before = torch.cuda.mem_get_info(self.runner.device)[0]
        for size in reversed(self.sizes):  # largest first: smaller graphs reuse its pool blocks
            self.graphs[size], self.logits[size] = capture_graph(stream, pool, lambda: self._run_model(size))
        torch.cuda.synchronize(self.runner.device)
        used = (free_before - torch.cuda.mem_get_info(self.runner.device)[0]) / 2**20
        logger.info(
            "captured %s CUDA graphs for %d token counts up to %d, %d requests at most (%.0f MiB)",
            "verify" if self.keep_all else "prefill",
            len(self.sizes),
            self.max_tokens,
            self.max_reqs,
            used,
        )

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [b, vocab] of the last token of each request of an extend batch (keep_all: [n, vocab],
        every token's); call on the forward stream."""
        n, b = batch.num_tokens, batch.batch_size
        size = next(s for s in self.sizes if s >= n)
        slots = self.num_slots(size)
        per_req = np.zeros((5, slots), dtype=np.int64)
        per_req[0] = self.pad_row
        per_req[0, :b] = batch.req_rows
        per_req[1, :b] = [s + k - 1 for s, k in zip(batch.extend_starts, batch.extend_lens)]
        per_req[2, :b] = batch.seq_lens
        per_req[3, :b] = batch.extend_lens
        per_req[4, :b] = batch.extend_starts
        per_req[2:, -1] = size - n, size - n, n  # the padding request: tokens n..size-1, no prefix
        uploaded = h2d_array(per_req, self.tokens.device)
        self.per_req[:, :slots].copy_(uploaded[:2])
        self.lens[:, :slots].copy_(uploaded[2:])
        if batch.spec is not None and batch.spec.moves:  # (an overlapped verify step's lengths: the device's)
            self.lens[0, :b].copy_(batch.seq_lens_dev)
        self.tokens[:, :n].copy_(batch.packed)  # one strided copy of the batch's upload
        if size > n:  # tokens a longer batch left behind become padding again
            self.tokens[:, n:size].zero_()
        if self.captured:
            self.graphs[size].replay()
            logits = self.logits[size]
        else:
            logits = self._run_model(size)
        self.replays += 1
        return logits[:n] if self.keep_all else logits[:b]
