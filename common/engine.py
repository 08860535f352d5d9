"""The colocated engine and its offline Python API.

    engine = Engine(EngineConfig(model_path="/models/tiny"))
    [c] = engine.generate(["Hello"], SamplingParams(max_new_tokens=8, temperature=0))

Two loops over the same scheduler and runner: `event_loop_overlap` (the default) launches batch N
before processing batch N-1, so the host's scheduling and result processing hide behind the
device's forward; `event_loop_normal` (--disable-overlap-schedule) is the plain serial twin. Both
give the same tokens.
"""

from __future__ import annotations

import gc
import itertools
import logging
import random
from collections import deque
from typing import Iterator, Sequence

from pdserve.common.batch import ForwardBatch, ForwardMode
from pdserve.common.config import EngineConfig
from pdserve.common.detokenizer import IncrementalDetokenizer
from pdserve.common.model_runner import ModelRunner
from pdserve.common.overlap import ForwardResult
from pdserve.common.sampling import SamplingBatchInfo, to_token_logprobs
from pdserve.common.scheduler import Scheduler
from pdserve.common.tokenizer import eos_token_ids, load_tokenizer
from pdserve.common.types import Completion, Req, SamplingParams

logger = logging.getLogger(__name__)

YOUNG_GC_THRESHOLD = 10_000


def tune_gc() -> None:
    """Keep Python's cyclic collector out of the serving loop's way (process-wide settings).

    NOTE: startup leaves ~300k long-lived objects (modules, model, tokenizer); the first full
    collection after it stalled a generate for ~150 ms (2-core host). Frozen, the collector only
    walks what serving allocates (vLLM's engine core freezes too); an object alive now that later
    becomes cyclic garbage is never collected. And at the default threshold of 700 the youngest
    generation was collected ~2 times per GPT-2 offline run of 128 requests, ~0.65 ms each; at
    10,000 not once (nearly everything serving allocates is freed by reference counting first).
    """
    gc.collect()
    gc.freeze()
    young, *older = gc.get_threshold()
    gc.set_threshold(max(young, YOUNG_GC_THRESHOLD), *older)


class Engine:
    # False on a decode server: its KV arrives over NIXL (only a retracted request is prefilled
    # again there, eagerly), so it captures no prefill graphs.
    runs_prefill = True

    def __init__(self, config: EngineConfig | None = None, **overrides):
        if config is None:
            config = EngineConfig(**overrides)
        elif overrides:
            raise TypeError("pass either a config or keyword overrides, not both")
        self.config = config.resolve()
        self.tokenizer = load_tokenizer(self.config.model_path)
        self.eos_token_ids = eos_token_ids(self.config.model_path, self.tokenizer)
        self.runner = ModelRunner(self.config, prefill_graphs=self.runs_prefill)
        self.scheduler = self.make_scheduler()
        self.streams = self.runner.streams
        self.war_barrier = True  # debug switch for the race test only: never turn off in serving
        self.trace: deque = deque(maxlen=4096)  # ("launch" | "process", batch.seq), for ordering tests
        self._launches = itertools.count()
        seed = None if self.config.random_seed < 0 else self.config.random_seed
        self._rng = random.Random(seed)
        self._ids = itertools.count()
        self._serial_loop = LoopState(self, overlap=False)
        if self.runner.device.type == "cuda":
            seconds = self.runner.warmup(self.config.chunked_prefill_size if self.config.chunked_prefill_size > 0 else 8192)
            logger.info("prefill kernels warmed up in %.2f s", seconds)
        tune_gc()

    def make_scheduler(self) -> Scheduler:
        """The scheduler of this role (the prefill and decode servers bring their own)."""
        return Scheduler(self.config, self.runner.req_to_token_pool, self.runner.kv_pool, self.eos_token_ids)

    @property
    def max_context_len(self) -> int:
        return self.config.context_length

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

    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams, rid: str | None = None) -> str:
        """Queue one sequence; raises ValueError (and queues nothing) when it cannot be served."""
        req = self.make_req(prompt_ids, params, rid)
        self.scheduler.add_request(req)
        return req.rid

    def make_req(self, prompt_ids: Sequence[int], params: SamplingParams, rid: str | None = None) -> Req:
        """A checked request with its seed drawn (when the client gave none) and its detokenizer."""
        self.check_request(prompt_ids, params)
        return self._build_req(prompt_ids, params, rid if rid is not None else f"req-{next(self._ids)}")

    def _build_req(self, prompt_ids: Sequence[int], params: SamplingParams, rid: str) -> Req:
        """make_req without the checks (the caller made them)."""
        seed = params.seed % 2**64 if params.seed is not None else self._rng.getrandbits(64)
        req = Req(rid, prompt_ids, params, seed)  # Req copies the ids
        req.detokenizer = IncrementalDetokenizer(self.tokenizer, req.prompt_ids, params.skip_special_tokens)
        return req

    def abort(self, rid: str) -> Completion | None:
        return self.scheduler.abort(rid)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # ---- the loops ------------------------------------------------------------------------------

    def launch(self, batch: ForwardBatch) -> ForwardResult:
        batch.seq = next(self._launches)
        info = SamplingBatchInfo.from_reqs(batch.reqs, self.vocab_size, self.eos_token_ids, self.runner.device)
        slots = self.runner.future_map.alloc(batch.batch_size)
        result = self.runner.launch(batch, info, slots)
        self.scheduler.on_launched(batch, slots)
        self.trace.append(("launch", batch.seq))
        return result

    def process(self, batch: ForwardBatch, result: ForwardResult) -> list[Completion]:
        result.copy_done.synchronize()  # the one place the host waits for the device
        self.trace.append(("process", batch.seq))
        host = self.runner.host_sample_output(result)
        next_ids, logprobs = host.next_token_ids.tolist(), to_token_logprobs(host, batch.reqs)
        self.runner.release(result)
        return self.scheduler.process_batch_result(batch, next_ids, logprobs)

    def step(self) -> list[Completion]:
        """One serial iteration: schedule a batch, run it, process its result. Returns what finished."""
        return self._serial_loop.step()

    def event_loop_normal(self) -> Iterator[Completion]:
        """The serial loop (--disable-overlap-schedule): runs until nothing is queued or running."""
        while self._serial_loop.busy():
            yield from self._serial_loop.step()

    def event_loop_overlap(self) -> Iterator[Completion]:
        """Launch batch N, then process batch N-1 while the device runs N (seeds' event_loop_overlap)."""
        loop = LoopState(self, overlap=True)
        while loop.busy():
            yield from loop.step()

    def _must_run_serially(self, batch: ForwardBatch, last_mode) -> bool:
        """Cases where overlapping with the previous batch would be wrong or hurt.

        Penalties need the previous token's value on the host when the batch's sampling info is
        built; --serial-consecutive-prefill keeps a prefill from delaying the previous prefill's
        first token by one forward (TTFT).
        """
        if any(r.params.has_penalties for r in batch.reqs):
            return True
        consecutive_prefill = batch.mode is ForwardMode.EXTEND and last_mode is ForwardMode.EXTEND
        return self.config.serial_consecutive_prefill and consecutive_prefill

    def run_loop(self) -> Iterator[Completion]:
        return self.event_loop_normal() if self.config.disable_overlap_schedule else self.event_loop_overlap()


    # ---- offline API ----------------------------------------------------------------------------

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[Completion]:
        """Run prompts (text, or token ids) to completion together; results in input order.

        Text prompts are tokenized with the tokenizer's special tokens (BOS where it adds one).
        generate drives the loop itself, so it needs the engine to itself.
        """
        if self.has_work():
            raise RuntimeError("generate() needs an idle engine; requests added with add_request are pending")
        if params is None:
            params = SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        ids = [self.tokenizer(p)["input_ids"] if isinstance(p, str) else list(p) for p in prompts]
        for prompt_ids, p in zip(ids, params):
            self.check_request(prompt_ids, p)  # every prompt, before anything is queued
        rids = [f"req-{next(self._ids)}" for _ in ids]
        # Queue what the first prefill batch can take; the rest is queued once that batch is
        # launched, while the device runs it (the host's time to build the requests is then
        # hidden instead of delaying the first forward).
        later = deque(zip(rids, ids, params))

        def queue_next() -> int:
            rid, prompt_ids, p = later.popleft()
            self.scheduler.add_request(self._build_req(prompt_ids, p, rid))
            return len(prompt_ids)

        first_tokens = 0
        while later and first_tokens < self.scheduler.prefill_budget:
            first_tokens += queue_next()

        loop = LoopState(self, overlap=not self.config.disable_overlap_schedule)
        done: dict[str, Completion] = {}
        while loop.busy() or later:
            for c in loop.step():
                done[c.rid] = c
            while later:  # after the first launch
                queue_next()
        return [done[rid] for rid in rids]

    def stats(self) -> dict:
        pool = self.runner.kv_pool
        return {
            "kv_used_tokens": self.scheduler.kv_used_tokens(),
            "kv_cached_tokens": pool.used_tokens() - self.scheduler.kv_used_tokens(),
            "kv_total_tokens": pool.capacity_tokens,
            "running_requests": len(self.scheduler.running),
            "waiting_requests": len(self.scheduler.waiting),
        }

    def is_idle(self) -> bool:
        return self.scheduler.is_idle()


class LoopState:
    """One event loop, an iteration at a time, so a server can interleave it with its I/O.

    Serial: schedule, launch, process. Overlapped: schedule N, launch N, WAR barrier, process
    N-1 — the batches still in flight live here between iterations. `poll` runs at the top of
    each iteration (intake, transfer queues) and may return completions; with it, an iteration
    with nothing to run is normal (waiting for KV, say), without it that is a stall.
    """

    def __init__(self, engine: Engine, overlap: bool, poll=None):
        self.engine = engine
        self.overlap = overlap
        self.poll = poll
        self.inflight: deque[tuple[ForwardBatch, ForwardResult]] = deque()
        self.last_mode = None

    def busy(self) -> bool:
        return bool(self.inflight) or self.engine.scheduler.has_work()

    def step(self) -> list[Completion]:
        engine, streams = self.engine, self.engine.streams
        done = list(self.poll()) if self.poll is not None else []
        with streams.use(streams.schedule_stream):
            batch = engine.scheduler.get_next_batch_to_run()
            if batch is None:
                if self.inflight:
                    done += engine.process(*self.inflight.popleft())
                elif self.poll is None and engine.scheduler.has_work():
                    raise RuntimeError(f"scheduler stalled with work queued: {engine.stats()}")
                return done
            if not self.overlap:
                return done + engine.process(batch, engine.launch(batch))
            if self.inflight and engine._must_run_serially(batch, self.last_mode):
                done += engine.process(*self.inflight.popleft())
            self.inflight.append((batch, engine.launch(batch)))
            self.last_mode = batch.mode
            if engine.war_barrier:
                # WAR barrier: the next scheduling step rewrites req_to_token rows and KV slots
                # that this forward may still be reading.
                streams.schedule_stream.wait_stream(streams.forward_stream)
            if len(self.inflight) > 1:
                done += engine.process(*self.inflight.popleft())
            return done
