"""`bench serve --backend hf`: transformers generate behind the serving benchmark's request interface.

transformers has no server and no continuous batching, so this is static batching, in-process: a
worker thread takes every request that has arrived (at most --hf-batch-size), runs them to the end
as one `generate` call, then takes the next group; requests that arrive meanwhile wait, and that
wait is part of their TTFT. A streamer stamps every decoding step when its tokens reach the host
(generate copies them with `.cpu()`, which waits for the device), so each request's TTFT, ITL and
E2E are real times from its arrival to its own tokens.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from transformers.generation.streamers import BaseStreamer

from pdserve.bench.hf import check_generated, eos_ids, generate_kwargs
from pdserve.bench.loadgen import Chunk


@dataclass
class _Pending:
    prompt: list[int]
    deliver: Callable[[object], None]  # a Chunk or an exception, handed to the request's event loop


class _StepStamps(BaseStreamer):
    """Tells every request of the batch when each decoding step's tokens arrived on the host."""

    def __init__(self, batch: list[_Pending]):
        self.batch = batch
        self.prompt_seen = False
        self.steps = 0
        self.last = 0.0

    def put(self, value) -> None:
        if not self.prompt_seen:  # generate's first put is the prompt itself
            self.prompt_seen = True
            return
        self.last = time.perf_counter()
        self.steps += 1
        for pending in self.batch:
            pending.deliver(Chunk(self.last, tokens=True))

    def end(self) -> None:
        pass


class HFServer:
    def __init__(self, model, device: str, output_len: int, max_batch: int):
        self.model, self.device, self.output_len, self.max_batch = model, device, output_len, max_batch
        self.kwargs = generate_kwargs(model, output_len, temperature=0.0)
        self.eos = eos_ids(model)
        self.waiting: list[_Pending] = []
        self.wakeup = threading.Condition()
        self.closed = False
        self.worker = threading.Thread(target=self._serve_forever, name="hf-serve", daemon=True)
        self.worker.start()

    async def stream(self, prompt: list[int], output_len: int) -> AsyncIterator[Chunk]:
        if output_len != self.output_len:
            raise ValueError(f"this server generates {self.output_len} tokens per request, not {output_len}")
        loop, inbox = asyncio.get_running_loop(), asyncio.Queue()

        def deliver(item) -> None:  # called on the worker thread
            try:
                loop.call_soon_threadsafe(inbox.put_nowait, item)
            except RuntimeError:  # the request's event loop is gone (it timed out and the run ended)
                pass

        pending = _Pending(prompt, deliver)
        with self.wakeup:
            self.waiting.append(pending)
            self.wakeup.notify()
        while True:
            item = await inbox.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.usage_tokens is not None:
                return

    def close(self) -> None:
        with self.wakeup:
            self.closed = True
            self.wakeup.notify()
        self.worker.join()

    def _serve_forever(self) -> None:
        while True:
            with self.wakeup:
                while not self.waiting and not self.closed:
                    self.wakeup.wait()
                if self.closed:
                    return
                take = min(self.max_batch, len(self.waiting)) if self.max_batch else len(self.waiting)
                batch, self.waiting = self.waiting[:take], self.waiting[take:]
            self._run(batch)

    def _run(self, batch: list[_Pending]) -> None:
        import torch

        stamps = _StepStamps(batch)
        try:
            input_ids = torch.tensor([p.prompt for p in batch], device=self.device)  # equal lengths: no padding
            with torch.inference_mode():
                out = self.model.generate(
                    input_ids, attention_mask=torch.ones_like(input_ids), streamer=stamps, **self.kwargs
                )
            check_generated(out[:, input_ids.shape[1] :].tolist(), self.output_len, self.eos)
        except Exception as e:  # every request of the batch fails with it
            for pending in batch:
                pending.deliver(e)
            return
        for pending in batch:
            pending.deliver(Chunk(stamps.last, tokens=False, usage_tokens=stamps.steps))
