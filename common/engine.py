"""The colocated engine and its offline Python API.

    engine = Engine(EngineConfig(model_path="/models/tiny"))
    [c] = engine.generate(["Hello"], SamplingParams(max_new_tokens=8, temperature=0))

The loop is the plain serial one of the seeds (`event_loop_normal`): schedule, run, process, every
step. The overlapped loop (issue 4) reuses the same scheduler and runner.
"""

from __future__ import annotations

import itertools
import random
from typing import Iterable, Sequence

from pdserve.common.batch import ForwardBatch
from pdserve.common.config import EngineConfig
from pdserve.common.detokenizer import IncrementalDetokenizer
from pdserve.common.model_runner import ModelRunner
from pdserve.common.sampling import SamplingBatchInfo, to_token_logprobs
from pdserve.common.scheduler import Scheduler
from pdserve.common.tokenizer import eos_token_ids, load_tokenizer
from pdserve.common.types import Completion, Req, SamplingParams


class Engine:
    def __init__(self, config: EngineConfig | None = None, **overrides):
        if config is None:
            config = EngineConfig(**overrides)
        elif overrides:
            raise TypeError("pass either a config or keyword overrides, not both")
        self.config = config.resolve()
        self.tokenizer = load_tokenizer(self.config.model_path)
        self.eos_token_ids = eos_token_ids(self.config.model_path, self.tokenizer)
        self.runner = ModelRunner(self.config)
        self.scheduler = Scheduler(
            self.config, self.runner.req_to_token_pool, self.runner.kv_pool, self.eos_token_ids
        )
        seed = None if self.config.random_seed < 0 else self.config.random_seed
        self._rng = random.Random(seed)
        self._ids = itertools.count()

    @property
    def max_context_len(self) -> int:
        return self.config.context_length

    @property
    def vocab_size(self) -> int:
        return self.runner.vocab_size

    # ---- requests -------------------------------------------------------------------------------

    def check_request(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise ValueError, with a message for the client, when a request could never run."""
        bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {self.vocab_size}): {bad[:5]}")
        self.scheduler.check_request(list(prompt_ids), params)

    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams, rid: str | None = None) -> str:
        """Queue one sequence; raises ValueError (and queues nothing) when it cannot be served."""
        rid = rid if rid is not None else f"req-{next(self._ids)}"
        self.check_request(prompt_ids, params)
        seed = params.seed % 2**64 if params.seed is not None else self._rng.getrandbits(64)
        req = Req(rid, list(prompt_ids), params, seed)
        req.detokenizer = IncrementalDetokenizer(self.tokenizer, req.prompt_ids, params.skip_special_tokens)
        self.scheduler.add_request(req)
        return rid

    def abort(self, rid: str) -> Completion | None:
        return self.scheduler.abort(rid)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # ---- the loop -------------------------------------------------------------------------------

    def step(self) -> list[Completion]:
        """One iteration: schedule a batch, run it, process its result. Returns what finished."""
        batch = self.scheduler.get_next_batch_to_run()
        if batch is None:
            return []
        next_ids, logprobs = self.run_batch(batch)
        return self.scheduler.process_batch_result(batch, next_ids, logprobs)

    def run_batch(self, batch: ForwardBatch):
        info = SamplingBatchInfo.from_reqs(batch.reqs, self.vocab_size, self.eos_token_ids, self.runner.device)
        logits = self.runner.forward(batch)
        out = self.runner.sample(logits, info)
        return out.next_token_ids.tolist(), to_token_logprobs(out, batch.reqs)

    def event_loop_normal(self) -> Iterable[Completion]:
        """The serial loop: runs until nothing is queued or running."""
        while self.scheduler.has_work():
            yield from self.step()

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
        rids = []
        try:
            for prompt_ids, p in zip(ids, params):
                rids.append(self.add_request(prompt_ids, p))
        except Exception:
            for rid in rids:
                self.abort(rid)
            raise
        done = {c.rid: c for c in self.event_loop_normal()}
        return [done[rid] for rid in rids]

    def stats(self) -> dict:
        pool = self.runner.kv_pool
        return {
            "kv_used_tokens": pool.used_tokens(),
            "kv_total_tokens": pool.capacity_tokens,
            "running_requests": len(self.scheduler.running),
            "waiting_requests": len(self.scheduler.waiting),
        }

    def is_idle(self) -> bool:
        return self.scheduler.is_idle()
