"""Owns the device state: the model, the KV pools and the attention backend; runs one forward.

The scheduler decides what runs and does the KV bookkeeping; the runner turns a ForwardBatch into
next-token logits and samples them. It never looks at request state beyond what sampling needs.

With tensor parallelism (common/engine/tp.py) every rank has a runner holding its shard of the model
and its KV heads. Each forward ends with the full logits on every rank (the LM head's all-gather);
rank 0 samples (`launch`), and its token ids are broadcast, so every rank's FutureMap holds the
same ids and the next batch's placeholders resolve the same everywhere (`launch_replica`).
"""

from __future__ import annotations

import gc
import logging

import torch

from pdserve.common.config import EngineConfig, read_hf_config
from pdserve.common.engine.attention import create_backend
from pdserve.common.engine.batch import ForwardBatch
from pdserve.common.engine.cuda_graph import CudaGraphRunner
from pdserve.common.engine.host_kv_pool import HostKVPool
from pdserve.common.engine.kv_pool import FP8_KV_DTYPE, PagedKVPool, ReqToTokenPool
from pdserve.common.engine.kv_scales import calibrate_kv_scales, calibration_ids, checkpoint_kv_scales, log_scales
from pdserve.common.engine.models.loader import checkpoint_sources, load_model
from pdserve.common.engine.models.parallel import kv_heads_of_rank
from pdserve.common.engine.mps_check import check_gemms_under_mps
from pdserve.common.engine.overlap import DeviceStreams, ForwardResult, FutureMap, PinnedOutputs, QueuedForward
from pdserve.common.engine.prefill_graph import PrefillGraphRunner
from pdserve.common.engine.prompt_logprobs import score_prompt
from pdserve.common.engine.sampling import SampleOutput, SamplingBatchInfo, sample
from pdserve.common.engine.speculative import overlap as verify_overlap
from pdserve.common.engine.speculative.draft_memory import draft_reserve_bytes
from pdserve.common.engine.speculative.verify_graph import capture_verify_graphs
from pdserve.common.engine.tp import TPGroup
from pdserve.common.engine.warmup import dummy_extend, warmup
from pdserve.common.kv_transfer.base import KVSide
from pdserve.common.model_checks import model_kv_heads_of
from pdserve.common.scheduling.batch import ForwardMode
from pdserve.common.scheduling.pages import pages_for
from pdserve.common.startup import KV_POOL, StartupClock
from pdserve.common.tokenizer import load_tokenizer
from pdserve.common.types import MAX_TOP_LOGPROBS

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
KV_DTYPES = {**DTYPES, "fp8_e4m3": FP8_KV_DTYPE}


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        prefill_graphs: bool = True,
        tp: TPGroup | None = None,
        startup: StartupClock | None = None,
        kv_side: KVSide | None = None,
        host_copies=None,
    ):
        """`startup`: marks the start-up phases (weights, kv_pool, graphs) as they end. `kv_side`:
        a decode server's (RECEIVER) has twice the request rows (decode/scheduler.py: KV is
        granted to as many requests again as run, so the next ones' KV is there when a slot frees).
        `host_copies`: a TP server's rank 0 tells its other ranks of its host KV tier's copies (TPWorkers.host_copy)."""
        startup = startup or StartupClock()
        self.config = config
        self.tp = tp if tp is not None else TPGroup.single(torch.device(config.device))
        self.device = self.tp.device
        if self.device.type == "cuda" and self.device.index is not None:
            # NOTE Triton launches on the current device: an engine on cuda:1 whose process
            # starts on cuda:0 failed its first kernel ("cannot be accessed from Triton").
            torch.cuda.set_device(self.device)
        if self.device.type == "cuda":
            torch.ones(1, device=self.device).item()  # the CUDA context (and its first kernel): a phase of its own
            startup.mark("cuda_context")
        self.memory_report: dict | None = None  # what --mem-fraction-static measured, on CUDA
        self.dtype = DTYPES[config.dtype]
        self.model = load_model(
            config.model_path, self.dtype, self.device, self.tp, config.quantization, config.fp8_lm_head
        )
        self.vocab_size = self.model.arch.vocab_size
        startup.mark("weights")
        if config.attention_backend == "triton" and self.device.type == "cuda":
            self.model.fuse()  # the fast path: merged projections, fused small ops
        check_gemms_under_mps(self.model, self.dtype, self.device)  # (a server on part of the GPU)
        if self.device.type == "cuda":
            startup.mark("fuse")  # merged projections, and the GEMM check under MPS
        num_layers, kv_heads, head_dim = self.model.kv_geometry()  # this rank's KV heads
        model_kv_heads = model_kv_heads_of(read_hf_config(config.model_path))
        heads = kv_heads_of_rank(model_kv_heads, self.tp.size, self.tp.rank)
        assert len(heads) == kv_heads, (heads, kv_heads)
        kv_dtype = KV_DTYPES[config.kv_cache_dtype]
        bytes_per_token = 2 * num_layers * kv_heads * head_dim * kv_dtype.itemsize
        self.kv_side = kv_side
        rows = config.max_running_requests * (2 if kv_side is KVSide.RECEIVER else 1)
        self.req_to_token_pool = ReqToTokenPool(rows, config.context_length, self.device)
        # Rank 0 hands out page ids for every rank: all pools have the smallest rank's page count.
        num_pages = self.tp.min_int(1 + self._kv_pages(bytes_per_token))
        self.kv_pool = PagedKVPool(
            num_pages=num_pages,
            page_size=config.page_size,
            num_layers=num_layers,
            kv_heads=kv_heads,
            head_dim=head_dim,
            dtype=kv_dtype,
            device=self.device,
            head_start=heads.start,
            model_kv_heads=model_kv_heads,
        )
        if self.kv_pool.quantized:
            self.kv_pool.set_scales(*self._kv_scales(num_layers))
        if config.host_kv_cache_gb > 0:
            self.kv_pool.host_tier = HostKVPool.for_gb(
                config.host_kv_cache_gb, self.kv_pool, write_policy=config.host_kv_write_policy, mirror=host_copies
            )
        startup.mark(KV_POOL)
        num_heads = self.model.local_heads()
        self.attn = create_backend(
            config.attention_backend, self.req_to_token_pool, self.kv_pool, num_heads, config.max_running_requests
        )
        self.streams = DeviceStreams(self.device)
        self.future_map = FutureMap(config.max_running_requests, self.device)
        self.future_map.counts_read = bool(config.speculative)
        # A verify step samples every position: 1 + --num-speculative-tokens rows per request.
        rows = config.max_running_requests * (1 + (config.num_speculative_tokens if config.speculative else 0))
        self.pinned = PinnedOutputs(rows, MAX_TOP_LOGPROBS, self.device)
        # Test hook: called on the forward stream before the model runs (e.g. a GPU sleep that
        # widens race windows). None in production.
        self.before_forward = None
        if config.tp_all_reduce == "symm" and self.tp.size > 1 and self.device.type == "cuda":
            from pdserve.common.engine.tp_symmetric import SymmetricAllReduce

            per_request = 1 + (config.num_speculative_tokens if config.speculative else 0)  # (a verify step's)
            tokens = min(config.cuda_graph_max_bs or 256, config.max_running_requests) * per_request
            self.tp.symmetric = SymmetricAllReduce.setup(self.tp, tokens * self.model.arch.hidden, self.dtype)
        startup.mark("buffers")
        self.cuda_graphs = self._capture_cuda_graphs()
        if self.cuda_graphs is not None:
            startup.mark("decode_graphs")
        self.prefill_graphs = self._capture_prefill_graphs() if prefill_graphs else None
        if self.prefill_graphs is not None:
            startup.mark("prefill_graphs")
        # (a prefill server samples first tokens only: it never speculates)
        self.verify_graphs = capture_verify_graphs(self, bool(config.speculative) and kv_side is not KVSide.SENDER)
        if self.verify_graphs is not None:
            startup.mark("verify_graphs")

    def _kv_scales(self, num_layers: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The FP8 KV cache's scales: the checkpoint's, else calibrated now (before any graph is
        captured; the graphs read the pool's scale tensors, whatever they hold)."""
        path = self.config.model_path
        scales = checkpoint_kv_scales(checkpoint_sources(path, read_hf_config(path)), num_layers)
        source = "checkpoint"
        if scales is None:
            ids = calibration_ids(load_tokenizer(path), self.vocab_size)
            scales = calibrate_kv_scales(self.model, ids, self.dtype, self.device)
            # NOTE each rank saw its own heads: every rank takes the largest, so all ranks (and a server
            # of another TP size, whose KV this one may receive or send) scale a layer alike.
            scales = tuple(self.tp.all_reduce_max(s.to(self.device)).cpu() for s in scales)
            source = f"calibrated on {len(ids)} tokens"
        log_scales(source, *scales)
        return scales

    def release_graphs(self) -> None:
        """Free the CUDA graphs (their memory pool included), once nothing will replay them: under
        TP before the NCCL communicators they captured are destroyed (tp_worker.py)."""
        self.cuda_graphs = self.prefill_graphs = self.verify_graphs = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            gc.collect()

    def warmup(self, chunk_tokens: int) -> float:
        """Run the prefill path on dummy batches before the first request; returns the seconds (warmup.py)."""
        return warmup(self, chunk_tokens)

    def _dummy_extend(self, lens: list[int]) -> ForwardBatch:
        return dummy_extend(self, lens)

    def _capture_cuda_graphs(self) -> CudaGraphRunner | None:
        c = self.config
        if self.device.type != "cuda" or c.disable_cuda_graph:
            return None
        if c.attention_backend != "triton":
            # The torch-native decode sizes its tensors from host lengths: not capturable.
            logger.info("CUDA graphs need --attention-backend triton; decode runs eagerly")
            return None
        max_bs = min(c.cuda_graph_max_bs or 256, c.max_running_requests)
        return CudaGraphRunner(self, max_bs)

    def _capture_prefill_graphs(self) -> PrefillGraphRunner | None:
        c = self.config
        if self.cuda_graphs is None:  # not on CUDA, graphs turned off, or a backend that can't be captured
            return None
        longest = min(c.prefill_cuda_graph_max_tokens, c.max_prefill_tokens, self.req_to_token_pool.context_len)
        if c.chunked_prefill_size > 0:
            longest = min(longest, c.chunked_prefill_size)
        longest -= longest % 16
        if longest < 16:
            return None
        return PrefillGraphRunner(self, longest, pool=self.cuda_graphs.pool)

    def _kv_pages(self, bytes_per_token: int) -> int:
        c = self.config
        tokens = c.max_total_tokens
        if tokens == 0:
            tokens = int(self._kv_budget_bytes()) // bytes_per_token
            # --mem-fraction-static gives the KV cache all it measured, as SGLang does: the prefix
            # cache keeps finished requests' KV in whatever running requests leave. Otherwise (the
            # CPU default, or no prefix cache) more than every running request at full context
            # can never be used.
            if not c.mem_fraction_static or c.disable_radix_cache:
                tokens = min(tokens, c.max_running_requests * c.context_length)
        pages = pages_for(tokens, c.page_size)
        if pages < pages_for(c.context_length, c.page_size):
            raise ValueError(
                f"KV cache of {pages * c.page_size} tokens cannot hold one sequence of the context length "
                f"{c.context_length}; raise --max-total-tokens or lower --context-length"
            )
        return pages

    def _kv_budget_bytes(self) -> float:
        """Bytes for the KV cache: measured on CUDA with --mem-fraction-static, else the flag."""
        c = self.config
        if not c.mem_fraction_static:
            return c.kv_cache_memory_gb * 2**30
        torch.cuda.synchronize(self.device)
        gc.collect()  # blocks this process cached but no longer uses are not "in use"
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        in_use = total - free  # weights, the CUDA context, and anything else on the GPU
        # --speculative draft: its model loads after this pool (a prefill server never speculates)
        draft = 0 if self.kv_side is KVSide.SENDER else draft_reserve_bytes(c, self.dtype)
        budget = total * c.mem_fraction_static - in_use - draft
        self.memory_report = {"total": total, "in_use": in_use, "draft": draft, "kv_budget": budget}
        gib = f"{in_use / 2**30:.1f} GiB of {total / 2**30:.1f} GiB in use after loading" + (
            f", {draft / 2**30:.2f} GiB kept for the draft model" if draft else ""
        )
        logger.info(
            "GPU memory: %s; KV cache budget %.2f GiB (--mem-fraction-static %s)",
            gib,
            budget / 2**30,
            c.mem_fraction_static,
        )
        if budget <= 0:
            raise ValueError(f"--mem-fraction-static {c.mem_fraction_static} leaves no room for the KV cache: {gib}")
        return budget

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, input_ids: torch.Tensor, scored: list | None = None) -> torch.Tensor:
        """Next-token logits [batch_size, vocab] in the model's dtype, run eagerly. A batch scoring
        prompt tokens also appends their PromptLogprobs to `scored`."""
        self.attn.init_forward(batch)
        hidden = self.model(input_ids, batch.positions, batch, self.attn)
        if batch.mode is ForwardMode.EXTEND:
            if batch.prompt_logprob_index is not None:
                result = score_prompt(
                    self.model, hidden, batch.prompt_logprob_index, batch.prompt_logprob_targets, batch.prompt_top_n
                )
                if scored is not None:
                    scored.append(result)
            if not batch.verify:  # (a verify step samples every position)
                hidden = hidden[batch.last_indices]  # decode has one token per request already
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def launch(
        self,
        batch: ForwardBatch,
        info: SamplingBatchInfo,
        future_slots: list[int],
        grammar_mask: torch.Tensor | None = None,
    ) -> ForwardResult:
        """Queue forward + sample of `batch` and the copy of its results to pinned host memory.

        Returns at once; the host may read the result after `result.copy_done.synchronize()`.
        Sampled ids also go to the FutureMap slots `future_slots`, where later batches read them.
        `grammar_mask`: the rows' allowed tokens (host int32, common/engine/grammar.py), or None.
        """
        return self.launch_sample(batch, info, future_slots, self.launch_forward(batch), grammar_mask)

    @torch.inference_mode()
    def launch_forward(self, batch: ForwardBatch) -> "QueuedForward":
        """The first half of `launch`: queue the forward alone. Its logits wait on the device for
        `launch_sample` (a batch sampled under grammars whose masks the host is still computing)."""
        streams = self.streams
        with streams.use(streams.forward_stream):
            streams.forward_stream.wait_stream(streams.schedule_stream)
            if batch.spec is not None:  # a verify step: what the step before left on the device
                verify_overlap.resolve(batch, self.future_map, self.req_to_token_pool.req_to_token, self.attn.host_lens)
            if self.before_forward is not None:
                self.before_forward(batch)
            scored: list = []
            logits = self._logits(batch, scored)
        return QueuedForward(logits, scored)

    @torch.inference_mode()
    def launch_sample(
        self,
        batch: ForwardBatch,
        info: SamplingBatchInfo,
        future_slots: list[int],
        queued: "QueuedForward",
        grammar_mask: torch.Tensor | None = None,
    ) -> ForwardResult:
        """The second half of `launch`: sample the queued forward's logits, then copy to the host.
        A graph's logits live in its output buffer until the next replay, which the forward stream
        orders after this sample."""
        streams, scored = self.streams, queued.scored
        with streams.use(streams.forward_stream):
            mask = None
            if batch.spec is not None:  # (a verify step whose steps moved: its sampled rows' noise keys)
                verify_overlap.move_noise(info, batch.spec)
            if grammar_mask is not None:  # (Grammars pins it on CUDA)
                mask = grammar_mask.to(self.device, non_blocking=grammar_mask.is_pinned())
            out = sample(queued.logits, info, mask)
            if self.tp.size > 1:
                out.next_token_ids = self.tp.broadcast(out.next_token_ids.contiguous())  # to launch_replica
            if batch.spec is not None:  # (its accepted counts, and the token after them)
                verify_overlap.store(self.future_map, future_slots, out.next_token_ids, batch.spec)
            else:
                self.future_map.store(future_slots, out.next_token_ids)
            published = streams.event()
            published.record(streams.forward_stream)
        host = self.pinned.acquire()
        bs, k = info.batch_size, info.top_logprobs_k  # (a row per request; a verify step's, per position)
        with streams.use(streams.d2h_stream):
            streams.d2h_stream.wait_event(published)
            host.next_token_ids[:bs].copy_(out.next_token_ids, non_blocking=True)
            if out.logprobs is not None:
                host.logprobs[:bs].copy_(out.logprobs, non_blocking=True)
            if k:
                host.top_ids[:bs, :k].copy_(out.top_logprob_ids, non_blocking=True)
                host.top_logprobs[:bs, :k].copy_(out.top_logprobs, non_blocking=True)
            prompt = scored[0].to_host() if scored else None  # rare: into fresh pinned memory
            copy_done = streams.event()
            copy_done.record(streams.d2h_stream)
        return ForwardResult(
            host,
            bs,
            out.logprobs is not None,
            k,
            copy_done,
            published,
            keep_alive=[batch, info, out, scored, mask],
            prompt_logprobs=prompt,
        )

    @torch.inference_mode()
    def launch_replica(self, batch: ForwardBatch, future_slots: list[int]):
        """A TP rank other than 0: the same forward as rank 0's `launch` (its collectives meet
        rank 0's), then rank 0's sampled ids into this rank's FutureMap. Nothing comes back to the
        host; returns an event recorded after it, on the forward stream."""
        streams = self.streams
        with streams.use(streams.forward_stream):
            streams.forward_stream.wait_stream(streams.schedule_stream)
            if batch.spec is not None:  # a verify step: what the step before left here, as on rank 0
                verify_overlap.resolve(batch, self.future_map, self.req_to_token_pool.req_to_token, self.attn.host_lens)
            self._logits(batch)  # the full logits are rank 0's to sample
            rows = batch.num_tokens if batch.verify else batch.batch_size  # (a verify step samples every position)
            next_ids = self.tp.broadcast(torch.empty(rows, dtype=torch.int64, device=self.device))
            if batch.spec is not None:  # its accepted counts too: the next verify step's positions move by them
                verify_overlap.store(self.future_map, future_slots, next_ids, batch.spec)
            else:
                self.future_map.store(future_slots, next_ids)
            done = streams.event()
            done.record(streams.forward_stream)
        return done

    def _logits(self, batch: ForwardBatch, scored: list | None = None) -> torch.Tensor:
        """Next-token logits of `batch`: a graph replay where one fits, else eager (always when it
        scores prompt tokens: `scored` gets their PromptLogprobs). Call on the forward stream. Decode
        graphs resolve placeholders inside the graph; verify graphs keep every position's logits."""
        if batch.prompt_logprob_index is None:
            for graphs in (self.cuda_graphs, self.verify_graphs, self.prefill_graphs):
                if graphs is not None and graphs.can_run(batch):
                    return graphs.replay(batch)
        input_ids = self.future_map.resolve(batch.input_ids) if batch.has_placeholders else batch.input_ids
        return self.forward(batch, input_ids, scored)

    def host_sample_output(self, result: ForwardResult) -> SampleOutput:
        """The result's host copies, as a SampleOutput (call after copy_done.synchronize())."""
        h, bs, k = result.host, result.batch_size, result.top_k
        return SampleOutput(
            next_token_ids=h.next_token_ids[:bs],
            logprobs=h.logprobs[:bs] if result.has_logprobs else None,
            top_logprob_ids=h.top_ids[:bs, :k] if k else None,
            top_logprobs=h.top_logprobs[:bs, :k] if k else None,
        )

    def release(self, result: ForwardResult) -> None:
        """The host is done with the result: its pinned buffers and device tensors may be reused."""
        result.host.in_use = False
        result.keep_alive.clear()
