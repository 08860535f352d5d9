"""The draft model's half of a device (speculative decoding, --speculative draft): its weights, its own
paged KV pool and request rows, and two greedy forwards (argmax only: no sampling, no tensor parallelism):

    greedy   EXTEND: any number of tokens per request, for a catch-up where any request has more than one
             (its prompt in chunks, the first time it speculates; 2 tokens after a step that accepted
             every draft; more after steps that did not speculate); always eager
    decode   DECODE: one token per request (the forwards feeding each draft back, and the catch-up of a
             step's one new token); a replay of the draft model's CUDA graphs where they exist

The pieces are the model runner's (common/engine/model_runner.py): load_model, `fuse` under the same
conditions (Triton attention on CUDA: merged projections, fused small ops), PagedKVPool, ReqToTokenPool,
the attention backend, and its decode graphs' runner (common/engine/cuda_graph.py, through a thin adapter:
the draft's input ids are never FutureMap placeholders). The graphs are captured at start-up on CUDA with
Triton attention, unless --disable-cuda-graph, for every capture size up to the pool's rows (at most
--cuda-graph-max-bs), in a memory pool of their own: the target's graphs may run on the forward stream
while the draft's replay. Every draft forward runs on the draft's own stream (`drafting`), where the graphs
were captured and replay: not the scheduling stream, which waits behind the target's step in flight (the
loop's WAR barrier), so the drafts of an overlapped verify step are made while the target verifies the one
before. The static buffers are written there just before each replay, and every proposal ends with a host
read of its drafts, so no replay of one proposal is still queued when the next one writes them again. A
decode batch's `packed` [5, B] is
built on the device: the previous draft forward's argmax (never read back) over one upload of the rest.

The pool is the draft model's alone: the target's pages, prefix cache and page counts never see it.
Who holds which of its rows and pages is DraftProposer's (draft.py) bookkeeping.
"""

from __future__ import annotations

import contextlib
import itertools
from types import SimpleNamespace

import torch

from pdserve.common.config import EngineConfig
from pdserve.common.engine.attention import create_backend
from pdserve.common.engine.batch import ForwardBatch
from pdserve.common.engine.cuda_graph import CudaGraphRunner
from pdserve.common.engine.kv_pool import PagedKVPool, ReqToTokenPool
from pdserve.common.engine.model_runner import DTYPES
from pdserve.common.engine.models.loader import load_model
from pdserve.common.engine.overlap import h2d
from pdserve.common.scheduling.batch import ForwardMode


class DraftRunner:
    def __init__(self, config: EngineConfig, device: torch.device, rows: int, num_pages: int):
        """`rows` requests at once, `num_pages` pages of config.page_size tokens (page 0 reserved)."""
        self.device = device
        self.dtype = DTYPES[config.dtype]
        self.model = load_model(config.draft_model_path, self.dtype, device)
        self.vocab_size = self.model.arch.vocab_size
        triton_on_cuda = config.attention_backend == "triton" and device.type == "cuda"
        if triton_on_cuda:
            self.model.fuse()  # the target's fast path (ModelRunner): merged projections, fused small ops
        num_layers, kv_heads, head_dim = self.model.kv_geometry()
        self.req_to_token_pool = ReqToTokenPool(rows, config.context_length, device)
        self.kv_pool = PagedKVPool(
            num_pages=num_pages,
            page_size=config.page_size,
            num_layers=num_layers,
            kv_heads=kv_heads,
            head_dim=head_dim,
            dtype=self.dtype,  # (the draft's KV in the model's dtype, whatever --kv-cache-dtype says)
            device=device,
            head_start=0,
            model_kv_heads=kv_heads,
        )
        self.attn = create_backend(
            config.attention_backend, self.req_to_token_pool, self.kv_pool, self.model.local_heads(), rows
        )
        self.request_indices = torch.arange(rows, dtype=torch.int64, device=device)  # a decode batch's last_indices
        self.decode_forwards = 0  # DECODE-mode forwards run (graph replays or eager)
        # Every draft forward runs on this stream (`drafting`); its graphs are captured on it too.
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.graphs: CudaGraphRunner | None = None
        if triton_on_cuda and not config.disable_cuda_graph:
            self.graphs = self._capture(min(rows, config.cuda_graph_max_bs or rows))

    def _capture(self, max_bs: int) -> CudaGraphRunner:
        """The draft model's decode graphs, batch sizes up to `max_bs`, in a pool of their own. The runner
        expects a target's ModelRunner; the adapter gives it the draft's pieces, an identity FutureMap and
        a private capture stream, made to wait for the weights and pools written on the current one, and
        current while the runner writes its static buffers (so they are written before the capture reads them).
        NOTE not the target's forward stream: what a graph captures per stream (cuBLAS's workspace) would
        then be shared by the draft's replays and the target's, which may run at the same time."""
        if self.stream is None:
            self.stream = torch.cuda.Stream(self.device)
        stream = self.stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        adapter = SimpleNamespace(
            device=self.device,
            req_to_token_pool=self.req_to_token_pool,
            attn=self.attn,
            model=self.model,
            future_map=SimpleNamespace(resolve=lambda input_ids: input_ids),
            streams=SimpleNamespace(forward_stream=stream),
        )
        with torch.cuda.stream(stream):
            return CudaGraphRunner(adapter, max_bs)

    @contextlib.contextmanager
    def drafting(self):
        """Run the draft forwards inside on the draft model's own stream. They read and write only the
        draft's weights, pool and rows (and token ids uploaded from the host), so they wait for nothing the
        target queued: an overlapped verify step's drafts are made while the target verifies the step
        before (on the scheduling stream they would wait behind it, the loop's WAR barrier). NOTE nothing
        here waits for the current stream: whatever they read must be written on this stream or before
        start-up ended; every proposal ends with a host read of its drafts, which waits for this stream
        only."""
        if self.stream is None:
            yield
            return
        with torch.cuda.stream(self.stream):
            yield

    @property
    def graph_replays(self) -> int:
        return 0 if self.graphs is None else self.graphs.replays

    @torch.inference_mode()
    def greedy(
        self, input_ids: torch.Tensor, rows: list[int], starts: list[int], lens: list[int], slots: list[int]
    ) -> torch.Tensor:
        """One eager extend forward: request i (ReqToTokenPool row rows[i]) computes positions
        [starts[i], starts[i] + lens[i]), the tokens `input_ids` (device, flat, request after request),
        writing their KV to `slots` (flat too); returns each request's argmax after its last position [B],
        on the device (nothing is read back)."""
        positions = [p for s, n in zip(starts, lens) for p in range(s, s + n)]
        token_rows = [row for row, n in zip(rows, lens) for _ in range(n)]
        flat_starts = [0, *itertools.accumulate(lens)][:-1]
        last_indices = [s + n - 1 for s, n in zip(flat_starts, lens)]
        upload = h2d(positions + slots + token_rows + rows + last_indices, torch.int64, self.device)
        t, b = len(positions), len(rows)
        positions_dev, slots_dev = upload[:t], upload[t : 2 * t]
        rows_dev, last = upload[3 * t : 3 * t + b], upload[3 * t + b :]
        self.req_to_token_pool.write_slots(upload[2 * t : 3 * t], positions_dev, slots_dev)
        batch = ForwardBatch(
            mode=ForwardMode.EXTEND,
            reqs=[],
            input_ids=input_ids,
            positions=positions_dev,
            out_cache_loc=slots_dev,
            req_pool_indices=rows_dev,
            seq_lens=[s + n for s, n in zip(starts, lens)],
            extend_lens=list(lens),
            extend_starts=flat_starts,
            req_rows=list(rows),
            last_indices=last,
            samples=[True] * b,
            has_placeholders=False,
        )
        self.attn.init_forward(batch)
        hidden = self.model(input_ids, positions_dev, batch, self.attn)
        return self.model.compute_logits(hidden[last]).argmax(dim=-1)

    @torch.inference_mode()
    def decode(
        self, input_ids: torch.Tensor | list[int], rows: list[int], positions: list[int], slots: list[int]
    ) -> torch.Tensor:
        """One DECODE-mode forward: request i (row rows[i]) computes the one position positions[i], token
        input_ids[i] (a device tensor [B], e.g. the last forward's argmax, or host ints), writing its KV to
        slots[i]; returns each request's argmax [B] on the device (nothing is read back). A replay of the
        draft's CUDA graphs where one fits (on the current stream), else eager."""
        b = len(rows)
        seq_lens = [p + 1 for p in positions]
        if isinstance(input_ids, torch.Tensor):  # (stays on the device: one cat with the upload)
            rest = h2d(positions + slots + rows + seq_lens, torch.int64, self.device).view(4, b)
            packed = torch.cat([input_ids.view(1, b), rest])
        else:
            packed = h2d(list(input_ids) + positions + slots + rows + seq_lens, torch.int64, self.device).view(5, b)
        ids, positions_dev, slots_dev, rows_dev, lens_dev = packed
        self.req_to_token_pool.write_slots(rows_dev, positions_dev, slots_dev)
        batch = ForwardBatch(
            mode=ForwardMode.DECODE,
            reqs=[],
            input_ids=ids,
            positions=positions_dev,
            out_cache_loc=slots_dev,
            req_pool_indices=rows_dev,
            seq_lens=seq_lens,
            extend_lens=[1] * b,
            extend_starts=list(range(b)),
            req_rows=list(rows),
            last_indices=self.request_indices[:b],
            samples=[True] * b,
            has_placeholders=False,
            seq_lens_dev=lens_dev,
            packed=packed,
        )
        self.decode_forwards += 1
        if self.graphs is not None and self.graphs.can_run(batch):
            logits = self.graphs.replay(batch)  # (valid until the next replay, which the argmax precedes)
        else:
            self.attn.init_forward(batch)
            logits = self.model.compute_logits(self.model(ids, positions_dev, batch, self.attn))
        return logits.argmax(dim=-1)
