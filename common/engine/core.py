"""What every role's engine holds, and the steps every event loop calls.

    EngineCore
        runner          the model, the KV pools, the streams, FutureMap and pinned outputs
        builder         ScheduleBatch -> ForwardBatch: the scheduling side's device writes
        scheduler       the role's host-only scheduler (the role's constructor passes it to start())
        in_flight       launched batches whose results are not processed yet (common/engine/in_flight.py)
        tp_workers      with --tp-size N > 1: ranks 1..N-1 (tp_worker.py); this process is rank 0,
                        and every launch (and host KV tier copy) is sent to them first

The loops themselves live with their roles (common/engine/engine.py: colocated; prefill/loop.py;
decode/loop.py); the launch/process pair they share is here:
    launch(batch)                   launch forward + sample of batch N; it joins in_flight
    process_results_before(batch)   process N-1 once N is launched (the last one when nothing was)
`copy_done.synchronize()` in process_batch_result is the only place the host waits for the device.

A server attaches a channel (common/serving/scheduler_process.py): `recv_requests` reads it, blocking
briefly only when nothing runs, and the role's `process_input_requests` / `send_outputs` turn its
messages into requests and outputs into messages. Without one (the offline API, tests) requests
are added by calls and the loops yield their outputs."""

from __future__ import annotations

import contextlib
import itertools
import logging
import random
import time
import weakref
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Sequence

from pdserve.common.config import EngineConfig
from pdserve.common.detokenizer import IncrementalDetokenizer
from pdserve.common.engine.batch_builder import BatchBuilder
from pdserve.common.engine.grammar import Grammars
from pdserve.common.engine.grammar_startup import GrammarsAtStart
from pdserve.common.engine.in_flight import InFlight
from pdserve.common.engine.model_runner import ModelRunner
from pdserve.common.engine.overlap import ForwardResult, QueuedForward
from pdserve.common.engine.sampling import SamplingBatchInfo, to_token_logprobs
from pdserve.common.engine.speculative import step as speculative
from pdserve.common.gc_tuning import tune_gc
from pdserve.common.kv_transfer import early_agent
from pdserve.common.kv_transfer.base import KVSide
from pdserve.common.scheduling.batch import ForwardMode, ScheduleBatch
from pdserve.common.scheduling.output_processor import add_prompt_logprobs
from pdserve.common.startup import StartupClock
from pdserve.common.tokenizer import eos_token_ids, load_tokenizer
from pdserve.common.types import Req, SamplingParams

logger = logging.getLogger(__name__)

# A failed collective: how long to look for the dead TP rank (tp_worker.check_alive). NOTE its sockets close before
# its exit status can be read (looked at once: gloo's "Connection closed by peer", not "TP rank 1 exited").
DEAD_PEER_GRACE_S = 2.0


@dataclass
class DeferredSample:
    """A launched batch whose forward is queued and whose sampling waits for grammar masks."""

    forward_batch: object  # the ForwardBatch
    info: SamplingBatchInfo
    slots: list[int]
    queued: QueuedForward
    masks: object = None  # being filled once the tokens before it are accepted: Grammars' MaskFuture


class EngineCore:
    """Built in two steps by each role's constructor: `EngineCore.__init__` (tokenizer, TP ranks, the
    model runner and its pools), then the role's own parts (its KV agents, its scheduler) made from
    them, then `start(scheduler, startup)` (the warm-up). Whatever fails on the way closes what was
    opened (`closed_on_error`)."""

    def __init__(
        self,
        config: EngineConfig,
        startup: StartupClock,
        prefill_graphs: bool = True,
        kv_side: KVSide | None = None,
        kv_agent_name: str = "",
        kv_transfer_path: str = "auto",
        warm_grammars: bool = False,
    ):
        """`startup`: marks the start-up phases as they end (a server prints them; common/startup.py).
        `kv_side`: a prefill (SENDER) or decode (RECEIVER) server's engine; with TP, every rank then
        runs a KV transfer agent named after `kv_agent_name` (common/kv_transfer/rank_duty.py), a sender's
        reaching peers by `kv_transfer_path` (common/kv_transfer/direct.py TransferPath). `warm_grammars`:
        make structured output's machinery during start-up (a server's; common/engine/grammar_startup.py)."""
        self.config, self.kv_agent_name = config.resolve(), kv_agent_name
        startup.mark("config")
        self.tokenizer = load_tokenizer(self.config.model_path)
        self.eos_token_ids = eos_token_ids(self.config.model_path, self.tokenizer)
        startup.mark("tokenizer")
        # Structured output's machinery: made beside the model's loading (start() waits), else on first use.
        fence = self._after_queued_copies if self.config.device.startswith("cuda") else None
        self._grammars = GrammarsAtStart(self.config, self.tokenizer, self.eos_token_ids, fence, warm_grammars)
        startup.before_gpu()  # (a server sharing a GPU waits here for the one before: common/startup.py)
        self.tp_workers = None
        if self.config.tp_size > 1:
            from pdserve.common.engine.tp_worker import KVRanks, TPWorkers  # pyzmq and msgspec: only with TP

            kv = KVRanks(kv_side, kv_agent_name, kv_transfer_path) if kv_side is not None else None
            self.tp_workers = TPWorkers.start(self.config, prefill_graphs, kv)
            # Stops them with the engine (garbage-collected, or at exit) unless close() came first.
            weakref.finalize(self, self.tp_workers.close)
            startup.mark("tp_ranks")
        if kv_side is not None:  # its NIXL agent: made on a thread while the model loads (on CUDA: early_agent.py)
            early_agent.start(kv_agent_name, self.tp_workers.group.device if self.tp_workers else self.config.device)
        try:
            self.runner = ModelRunner(
                self.config,
                prefill_graphs=prefill_graphs,
                tp=self.tp_workers.group if self.tp_workers else None,
                startup=startup,
                kv_side=kv_side,
                host_copies=self.tp_workers and self.tp_workers.host_copy,
            )
        except BaseException:
            self.close(kill=True)
            raise
        self.builder = BatchBuilder(self.runner.req_to_token_pool, self.config.page_size)
        # Speculative decoding's proposer, which the role gives its scheduler (None: off). A prefill server
        # samples first tokens only: it never speculates, whatever the flags its decode servers share.
        self.proposer = speculative.make_proposer(self.config, self.runner) if kv_side is not KVSide.SENDER else None
        self.streams = self.runner.streams
        self.scheduler = None  # the role's: start() takes it
        self.in_flight = InFlight()
        self.outputs: list = []  # what this iteration finished, for send_outputs
        self.channel = None  # the scheduler process's I/O; None offline
        self.trace: deque = deque(maxlen=4096)  # ("launch" | "process", batch.seq), for ordering tests
        self._launches = itertools.count()
        self._rng = random.Random(None if self.config.random_seed < 0 else self.config.random_seed)
        self._ids = itertools.count()

    @contextlib.contextmanager
    def closed_on_error(self):
        """A role's construction step: on any failure, close what the engine opened (kill the TP ranks), then raise."""
        try:
            yield
        except BaseException:
            self.close(kill=True)
            raise

    def start(self, scheduler, startup: StartupClock) -> None:
        """The role's scheduler, then the warm-up: the engine is ready to run its loops."""
        self.scheduler = scheduler
        startup.mark("scheduler")
        if self.runner.device.type == "cuda":
            chunk = self.config.chunked_prefill_size
            seconds = self.runner.warmup(chunk if chunk > 0 else 8192)
            logger.info("prefill kernels warmed up in %.2f s", seconds)
            startup.mark("warmup")
        if self._grammars.wait():
            startup.mark("grammars")  # (what the model's loading did not hide of it)
        tune_gc()

    def close(self, kill: bool = False) -> None:
        """Stop the other TP ranks (nothing to do with tp = 1). The engine is unusable after."""
        early_agent.discard(self.kv_agent_name)  # (a start that failed before its KV agents opened)
        if self.tp_workers is not None:
            if not kill and not self.tp_workers.closed and getattr(self, "runner", None) is not None:
                self.runner.release_graphs()  # before the communicators they captured end
            self.tp_workers.close(kill=kill)

    def ranks_open_transfers(self) -> list[int]:
        """KV transfers each other TP rank still has open (asked now, answered within
        --dist-timeout); [] with tp = 1 or without KV agents. For checks that every rank is idle."""
        from pdserve.common.engine.tp_messages import Probe, RankState

        workers = self.tp_workers
        if workers is None or workers.reports is None:
            return []
        seq = time.monotonic_ns()  # answers to an earlier, timed-out probe are told apart by it
        workers.broadcast(Probe(seq))
        states = [s for s in workers.wait_for(RankState, len(workers.procs), "probe answers") if s.seq == seq]
        return [s.open_transfers for s in sorted(states, key=lambda s: s.rank)]

    @property
    def vocab_size(self) -> int:
        return self.runner.vocab_size

    # ---- requests -------------------------------------------------------------------------------

    def check_request(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise ValueError, with a message for the client, when a request could never run."""
        bad = []
        if prompt_ids and (min(prompt_ids) < 0 or max(prompt_ids) >= self.vocab_size):  # fast path: C loops
            bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {self.vocab_size}): {bad[:5]}")
        self.scheduler.check_request(prompt_ids, params)
        if params.grammar is not None:
            self.grammars.check(params.grammar)  # parsed here; compiled off the loop (Grammars.compile)

    @property
    def grammars(self) -> Grammars:
        """Structured output's compiler and cache (common/engine/grammar_startup.py)."""
        return self._grammars.get()

    def _after_queued_copies(self):
        """An event on the forward stream after everything queued on it so far (grammar masks' copies)."""
        streams = self.runner.streams
        event = streams.event()
        event.record(streams.forward_stream)
        return event

    def make_req(
        self, prompt_ids: Sequence[int], params: SamplingParams, rid: str | None = None, detokenize: bool = True
    ) -> Req:
        """A checked request with its seed drawn (when the client gave none); `detokenize` gives it a
        detokenizer (its text is built as it finishes, or per token for stop strings)."""
        self.check_request(prompt_ids, params)
        return self.build_req(prompt_ids, params, rid if rid is not None else f"req-{next(self._ids)}", detokenize)

    def build_req(self, prompt_ids: Sequence[int], params: SamplingParams, rid: str, detokenize: bool = True) -> Req:
        """make_req without the checks (the caller made them)."""
        seed = params.seed % 2**64 if params.seed is not None else self._rng.getrandbits(64)
        req = Req(rid, prompt_ids, params, seed)  # Req copies the ids
        if params.grammar is not None:
            k = params.resumed_output_tokens  # (output an earlier server produced: the grammar starts past it)
            req.grammar = self.grammars.matcher(params.grammar, req.prompt_ids[len(req.prompt_ids) - k :] if k else [])
        if detokenize:
            req.detokenizer = IncrementalDetokenizer(self.tokenizer, req.prompt_ids, params.skip_special_tokens)
        return req

    def abort(self, rid: str):
        return self.scheduler.abort(rid)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def busy(self) -> bool:
        """Something is queued, running, transferring or in flight on the device."""
        return bool(self.in_flight) or self.scheduler.has_work()

    def is_idle(self) -> bool:
        return not self.in_flight and self.scheduler.is_idle()

    def stats(self) -> dict:
        s, pool = self.scheduler, self.runner.kv_pool
        return {
            "kv_used_tokens": s.kv_used_tokens(),
            "kv_cached_tokens": pool.used_tokens() - s.kv_used_tokens(),
            "kv_total_tokens": pool.capacity_tokens,
            "running_requests": s.num_running(),
            "waiting_requests": len(s.prefill.waiting),
        }

    # ---- the steps every loop calls ------------------------------------------------------------

    def recv_requests(self) -> list:
        """The channel's messages; blocks (briefly) only when nothing runs. A server whose TP rank died stops here."""
        if self.tp_workers is not None:
            self.tp_workers.check_alive_now_and_then(time.monotonic())
        return self.channel.recv(block=not self.busy()) if self.channel is not None else []

    def get_next_batch_to_run(self) -> ScheduleBatch | None:
        if self.proposer is not None and self.in_flight and self.scheduler.results_first():
            # NOTE a verify step's token count is known on the host only once it is processed: a step after
            # one in flight is an overlapped verify step (its positions move on the device), or the loop
            # runs serially here (Scheduler.results_first; docs/architecture.md, "Speculative decoding").
            self.process_results_before(None)
        return self.scheduler.get_next_batch_to_run()

    def launch(self, batch: ScheduleBatch) -> None:
        """Launch batch N (run_batch); it stays in flight until process_results_before takes it."""
        self.in_flight.push(batch, self.run_batch(batch))

    def run_batch(self, batch: ScheduleBatch) -> ForwardResult:
        """Queue batch N's forward + sample and the copy of its results to pinned memory; returns
        at once. The batch's device inputs are built here, on the current (schedule) stream."""
        batch.seq = next(self._launches)
        forward_batch = self.builder.build(batch)
        # NOTE: built before the previous result is processed: that may finish (and free) a
        # request of this batch, whose token is then discarded (Scheduler.on_launched).
        if self.in_flight and self.must_run_serially(batch):
            self.process_results_before(None)
        info = speculative.sampling_info(batch, self.vocab_size, self.eos_token_ids, self.runner.device)
        slots = self.runner.future_map.alloc(batch.batch_size)  # (a verify step's: its last tokens and counts)
        # The previous batch's sampling, whose tokens this forward reads: launched only now, so
        # this batch was built while its grammar masks were filling (the host's chain from one
        # batch's tokens to the next one's sampling is a Llama-1B step's critical path).
        self.launch_deferred()
        if self.tp_workers is not None:
            self.tp_workers.send(forward_batch.plan, slots)  # the other ranks run the same forward
        try:
            if any(r.grammar is not None and r.pending for r in batch.reqs):
                # A grammar's mask needs the token still in flight: sampled once it is processed.
                result = DeferredSample(forward_batch, info, slots, self.runner.launch_forward(forward_batch))
            else:
                result = self.runner.launch(
                    forward_batch,
                    info,
                    slots,
                    speculative.row_masks(self.grammar_bitmask(batch, launched=False).result(), batch),
                )
        except RuntimeError:
            if self.tp_workers is not None:
                self.tp_workers.check_alive(DEAD_PEER_GRACE_S)  # a collective failed: name the rank that died
            raise
        self.scheduler.on_launched(batch, slots)
        self.trace.append(("launch", batch.seq))
        return result

    def sample_deferred(self, batch: ScheduleBatch, deferred: DeferredSample) -> ForwardResult:
        """Launch the sampling of a batch whose forward is queued (run_batch), with its grammar
        masks. Its masks are filled once every earlier batch's tokens are on the host and accepted
        by the matchers: each has then accepted every token but the one this batch samples.

        NOTE the overlap this keeps: the device runs batch N's forward while the host reads N-1's
        tokens, advances the matchers by them and fills N's masks (in the grammar worker process,
        while this thread processes N-1, schedules and builds N+1); only the sampling, a few small
        kernels, waits for the host, and it is launched before N+1's forward, which reads its
        tokens. The matcher lags the device by one step, as the tokens do, and the mask is
        filled after the lag is made up, so it is the right one.
        """
        masks = deferred.masks if deferred.masks is not None else self.grammar_bitmask(batch, launched=True)
        try:
            return self.runner.launch_sample(
                deferred.forward_batch, deferred.info, deferred.slots, deferred.queued, masks.result()
            )
        except RuntimeError:
            if self.tp_workers is not None:
                self.tp_workers.check_alive(DEAD_PEER_GRACE_S)
            raise

    def launch_deferred(self) -> None:
        """Launch the sampling of queued batches whose masks are being filled."""

        def launched(batch: ScheduleBatch, result):
            if isinstance(result, DeferredSample) and result.masks is not None:
                return self.sample_deferred(batch, result)
            return result

        self.in_flight.map_results(launched)

    def grammar_bitmask(self, batch: ScheduleBatch, launched: bool):
        """The batch's grammar masks (host), filling: a future whose result() is the mask, or
        None when none of its requests has a grammar."""
        if not any(r.grammar is not None for r in batch.reqs):
            done: Future = Future()
            done.set_result(None)
            return done
        return self.grammars.bitmask(batch.reqs, batch.samples, launched)

    def process_batch_result(self, batch: ScheduleBatch, result: ForwardResult) -> None:
        if isinstance(result, DeferredSample):  # (a loop that processes it before sampling it)
            result = self.sample_deferred(batch, result)
        if self.tp_workers is None:
            result.copy_done.synchronize()  # the one place the host waits for the device
        else:
            self.tp_workers.wait(result.copy_done)  # the same wait, noticing a rank that dies meanwhile
        self.trace.append(("process", batch.seq))
        host = self.runner.host_sample_output(result)
        next_ids = host.next_token_ids.tolist()
        waiting, deferred = self.in_flight.oldest() or (None, None)
        if isinstance(deferred, DeferredSample):
            # The next batch's sampling waits for these tokens' grammar masks: the matchers
            # accept them and fill its masks in the grammar worker while the scheduler processes
            # this batch below; the sampling is launched before anything reads its tokens
            # (launch_deferred).
            deferred.masks = self.grammars.accept_and_fill(
                batch.reqs, batch.samples, next_ids, waiting.reqs, waiting.samples
            )
        logprobs = to_token_logprobs(host, speculative.row_owners(batch))
        if result.prompt_logprobs is not None:
            add_prompt_logprobs(batch, result.prompt_logprobs)
        self.runner.release(result)
        if batch.drafts is not None:
            accepted = speculative.accepted_counts(next_ids, batch.drafts)
            self.outputs += self.scheduler.process_verify_result(batch, next_ids, logprobs, accepted)
            return
        self.outputs += self.scheduler.process_batch_result(batch, next_ids, logprobs)

    def process_results_before(self, batch: ScheduleBatch | None) -> None:
        """Process every launched batch before `batch`: N-1 right after N is launched, or the last
        one when nothing was launched this iteration."""
        for launched, result in self.in_flight.take_before(batch):
            self.process_batch_result(launched, result)

    def must_run_serially(self, batch: ScheduleBatch) -> bool:
        """Cases where overlapping with the previous batch would be wrong or hurt.

        Penalties need the previous token's value on the host when the batch's sampling info is
        built; --serial-consecutive-prefill keeps a prefill from delaying the previous prefill's
        first token by one forward (TTFT).
        """
        if any(r.params.has_penalties for r in batch.reqs):
            return True
        last = self.in_flight.last_batch()
        consecutive_prefill = batch.mode is ForwardMode.EXTEND and last is not None and last.mode is ForwardMode.EXTEND
        return self.config.serial_consecutive_prefill and consecutive_prefill

    def take_outputs(self) -> list:
        outputs, self.outputs = self.outputs, []
        return outputs
