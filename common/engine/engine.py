"""The colocated engine, its two loops, and its offline Python API.

    engine = Engine(EngineConfig(model_path="/models/tiny"))
    [c] = engine.generate(["Hello"], SamplingParams(max_new_tokens=8, temperature=0))

`event_loop_overlap` (the default) launches batch N before processing batch N-1, so the host's
scheduling and result processing hide behind the device's forward; `event_loop_normal`
(--disable-overlap-schedule) is the plain serial twin. Both give the same tokens. Each yields,
after every iteration, the completions it finished; the caller decides when to stop.
"""

from __future__ import annotations

from collections import deque
from typing import Iterator, Sequence

from pdserve.common.config import EngineConfig
from pdserve.common.engine.core import EngineCore
from pdserve.common.scheduling.batch import ScheduleBatch
from pdserve.common.scheduling.scheduler import Scheduler
from pdserve.common.startup import StartupClock
from pdserve.common.types import Completion, SamplingParams


def event_loop_overlap(engine: Engine) -> Iterator[list[Completion]]:
    """seeds' event_loop_overlap: schedule and launch N, WAR barrier, then process N-1."""
    schedule_stream, forward_stream = engine.streams.schedule_stream, engine.streams.forward_stream
    while True:
        with engine.streams.use(schedule_stream):  # scheduling's device writes queue here
            batch = engine.get_next_batch_to_run()
            if batch is not None:
                engine.launch(batch)  # N
                # WAR barrier: the next scheduling step rewrites req_to_token rows and KV slots
                # that this forward may still be reading.
                schedule_stream.wait_stream(forward_stream)
            engine.check_not_stalled(batch)
            engine.process_results_before(batch)  # N-1, while the device runs N
        yield engine.take_outputs()


def event_loop_normal(engine: Engine) -> Iterator[list[Completion]]:
    """The serial twin: schedule, run, process."""
    streams = engine.streams
    while True:
        with streams.use(streams.schedule_stream):
            batch = engine.get_next_batch_to_run()
            if batch is not None:
                engine.process_batch_result(batch, engine.run_batch(batch))
        engine.check_not_stalled(batch)
        yield engine.take_outputs()


class Engine(EngineCore):
    def __init__(self, config: EngineConfig | None = None, **overrides):
        if config is None:
            config = EngineConfig(**overrides)
        elif overrides:
            raise TypeError("pass either a config or keyword overrides, not both")
        startup = StartupClock()
        super().__init__(config, startup)
        with self.closed_on_error():
            runner = self.runner
            scheduler = Scheduler(
                self.config, runner.req_to_token_pool, runner.kv_pool, self.eos_token_ids, proposer=self.proposer
            )
        self.start(scheduler, startup)

    @property
    def max_context_len(self) -> int:
        return self.config.context_length

    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams, rid: str | None = None) -> str:
        """Queue one sequence; raises ValueError (and queues nothing) when it cannot be served."""
        req = self.make_req(prompt_ids, params, rid)
        self.scheduler.add_request(req)
        return req.rid

    def check_not_stalled(self, batch: ScheduleBatch | None) -> None:
        """Nothing ran and nothing is in flight, yet work is queued: a scheduling bug, never a wait
        (a colocated engine waits on nothing outside itself but its host-tier copies)."""
        if (
            batch is None
            and not self.in_flight
            and self.scheduler.has_work()
            and not self.scheduler.prefill.waiting_on_loads()
        ):
            raise RuntimeError(f"scheduler stalled with work queued: {self.stats()}")

    def event_loop(self) -> Iterator[list[Completion]]:
        """The configured loop (overlapped unless --disable-overlap-schedule)."""
        return event_loop_normal(self) if self.config.disable_overlap_schedule else event_loop_overlap(self)

    def run_loop(self) -> Iterator[Completion]:
        """The configured loop until nothing is queued, running or in flight."""
        loop = self.event_loop()
        while self.busy():
            yield from next(loop)

    def step(self) -> list[Completion]:
        """One serial iteration: schedule a batch, run it, process its result. Returns what finished."""
        if self.in_flight:
            raise RuntimeError("step() needs no batch in flight")
        return next(event_loop_normal(self))

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
        if self.busy():
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
            self.scheduler.add_request(self.build_req(prompt_ids, p, rid))
            return len(prompt_ids)

        first_tokens = 0
        while later and first_tokens < self.scheduler.prefill_budget:
            first_tokens += queue_next()

        loop = self.event_loop()
        done: dict[str, Completion] = {}
        while self.busy() or later:
            for c in next(loop):
                done[c.rid] = c
            while later:  # after the first launch
                queue_next()
        return [done[rid] for rid in rids]
