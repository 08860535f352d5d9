"""CUDA graphs for decode: one captured forward per padded batch size, replayed on the forward stream.

A decode step of a small model is a few hundred short kernels; launched one by one from Python the
host is the bottleneck (measured: ~5 ms per GPT-2 step, device idle most of it). A graph launches
them all at once. What a graph captures, from static input buffers to a static logits buffer:

    input_ids (FutureMap placeholders allowed) -> FutureMap.resolve -> model -> logits [N, vocab]

Resolving placeholders inside the graph keeps the overlap loop intact: the previous step's sampled
ids are read on the device, in stream order, when the graph runs. Sampling stays outside (its
tensors differ per batch: greedy is one argmax).

A batch of n requests replays the smallest captured size N >= n. Rows n..N-1 are padding: token 0
at position 0, writing its KV to slot 0 and reading through `ReqToTokenPool.pad_row` (all zeros,
page 0, which is never handed out), seq_len 1. Their logits are sliced off.

NOTE the static buffers are written only on the forward stream, just before the replay, so a
write can never overtake a graph still reading them (same stream, in order). All graphs share one
memory pool, so their outputs alias: `replay`'s logits are valid until the next replay is queued,
and the sampling that reads them is queued on the same stream first.
"""

from __future__ import annotations

import logging

import torch

from pdserve.common.engine.batch import ForwardBatch
from pdserve.common.scheduling.batch import ForwardMode

logger = logging.getLogger(__name__)

CAPTURE_MODE = "thread_local"  # see capture_graph


def capture_graph(stream, pool, run) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """Capture `run()` (which returns the output tensor) on `stream` into `pool`.

    Run twice first, outside capture: compiles the kernels and settles the allocator.

    NOTE: "thread_local": other threads of the process call CUDA while we capture (NIXL's progress
    thread, the grammar and host-copy threads). In torch's default "global" mode any call of theirs that
    CUDA deems unsafe during a capture (a cudaFree, a synchronizing copy) invalidates ours
    (tests/gpu/test_capture_beside_threads.py).
    """
    with torch.cuda.stream(stream):
        for _ in range(2):
            run()
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode=CAPTURE_MODE):
        out = run()
    return graph, out


def capture_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 to 64, every 16 to 256 (and max_bs itself)."""
    sizes = [1, 2, 4] + list(range(8, 64, 8)) + list(range(64, 257, 16))
    return sorted({s for s in sizes if s < max_bs} | {max_bs})


class CudaGraphRunner:
    def __init__(self, runner, max_bs: int):
        self.runner = runner
        self.sizes = capture_sizes(max_bs)
        n, device = self.sizes[-1], runner.device
        self.pad_row = runner.req_to_token_pool.pad_row
        # Static inputs, one row each (the layout of a decode batch's upload, ForwardBatch.packed):
        # input_ids, positions, out_cache_loc, req_pool_indices, seq_lens.
        self.static = torch.zeros((5, n), dtype=torch.int64, device=device)
        self.input_ids, self.positions, self.out_cache_loc, self.req_pool_indices, self.seq_lens = self.static
        # What a padded row holds: token 0 at position 0, slot 0, the all-zero row, seq_len 1.
        self.padding = torch.tensor([[0], [0], [0], [self.pad_row], [1]], dtype=torch.int64, device=device).expand(5, n)
        self.static.copy_(self.padding)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.replays = 0
        self._capture_all()

    @property
    def max_bs(self) -> int:
        return self.sizes[-1]

    def can_run(self, batch: ForwardBatch) -> bool:
        return batch.mode is ForwardMode.DECODE and batch.packed is not None and batch.batch_size <= self.max_bs

    def _static_batch(self, bs: int) -> ForwardBatch:
        """The ForwardBatch the captured model sees: views of the static buffers."""
        return ForwardBatch(
            mode=ForwardMode.DECODE,
            reqs=[],
            input_ids=self.input_ids[:bs],
            positions=self.positions[:bs],
            out_cache_loc=self.out_cache_loc[:bs],
            req_pool_indices=self.req_pool_indices[:bs],
            seq_lens=[1] * bs,
            extend_lens=[1] * bs,
            extend_starts=list(range(bs)),
            req_rows=[self.pad_row] * bs,
            last_indices=torch.arange(bs, device=self.input_ids.device),
            samples=[True] * bs,
            has_placeholders=True,
            seq_lens_dev=self.seq_lens[:bs],
        )

    def _run_model(self, bs: int) -> torch.Tensor:
        r = self.runner
        batch = self._static_batch(bs)
        r.attn.bind_decode(batch.req_pool_indices, batch.seq_lens_dev)
        input_ids = r.future_map.resolve(batch.input_ids)
        hidden = r.model(input_ids, batch.positions, batch, r.attn)
        return r.model.compute_logits(hidden)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        stream = self.runner.streams.forward_stream
        free_before = torch.cuda.mem_get_info(self.runner.device)[0]
        for bs in reversed(self.sizes):  # largest first: smaller graphs reuse its pool blocks
            self.graphs[bs], self.logits[bs] = capture_graph(stream, self.pool, lambda: self._run_model(bs))
        torch.cuda.synchronize(self.runner.device)
        used = (free_before - torch.cuda.mem_get_info(self.runner.device)[0]) / 2**20
        logger.info("captured decode CUDA graphs for batch sizes %s (%.0f MiB)", self.sizes, used)

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [n, vocab] of a decode batch; call on the forward stream."""
        n = batch.batch_size
        size = next(s for s in self.sizes if s >= n)
        self.static[:, :n].copy_(batch.packed[:5])  # one strided copy of the batch's upload
        if size > n:  # rows a larger batch left behind become padding again
            self.static[:, n:size].copy_(self.padding[:, : size - n])
        self.graphs[size].replay()
        self.replays += 1
        return self.logits[size][:n]
