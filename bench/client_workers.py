"""`bench serve --client-workers N`: the load generator in N processes, so that at 100k+ streamed
tokens/s the client (one asyncio loop parsing every SSE chunk) is never the bottleneck.

Per run, the parent draws the arrival times exactly as one process would (loadgen.arrival_times),
deals the requests round-robin to the workers and splits --max-concurrency among them; every
worker sends its share from one common start and hands back its RequestResults, which the parent
merges in prompt order and summarizes as usual. Only plain data crosses the local pipes:
msgspec-encoded token ids, times and results.

    parent                                   worker i (spawned once, kept for every run)
    Job(prompts[i::n], offsets[i::n], ...) ->
                                          <- READY (decoded, waiting)
    Start(wall-clock time)                ->  sleeps until then, sends on schedule
                                          <- Done(results, last answer, own CPU seconds)
    STOP (b"")                            ->  exits
"""

from __future__ import annotations

import asyncio
import multiprocessing
import time

import msgspec

from pdserve.bench.loadgen import OpenAIBackend, arrival_times, per_request, send_on_schedule
from pdserve.bench.metrics import RequestResult
from pdserve.common.gc_tuning import tune_gc

# NOTE: the common start is set this far after the last worker said READY, so every worker has
# read it before it comes. A worker that still reads it late just sends its first requests late
# (their TTFT starts at the real send); the run's duration counts from the common start.
START_MARGIN_S = 0.05
READY, STOP = b"ready", b""
STOP_TIMEOUT_S = 5.0


class Job(msgspec.Struct, frozen=True):
    """One run's share for one worker."""

    prompts: list[list[int]]
    offsets: list[float]  # send times, seconds after the common start
    output_lens: list[int]  # each prompt's output tokens (ignore_eos)
    max_concurrency: int  # this worker's share of the limit; 0: no limit
    timeout_s: float


class Start(msgspec.Struct, frozen=True):
    wall_time: float  # time.time() at which offset 0 falls, the same for every worker


class Done(msgspec.Struct, frozen=True):
    results: list[RequestResult]  # in the order of the Job's prompts
    last_answer_s: float  # seconds from the common start to this worker's last answer
    cpu_s: float  # this worker's process CPU time over the run (user + system, all threads)


def split_concurrency(max_concurrency: int, workers: int) -> list[int]:
    """Each worker's share of max_concurrency, as even as possible, the larger shares first
    (the workers dealt the most requests); 0 (no limit) stays 0. Needs workers <= max_concurrency."""
    if max_concurrency == 0:
        return [0] * workers
    share, extra = divmod(max_concurrency, workers)
    return [share + (1 if i < extra else 0) for i in range(workers)]


class ClientWorkers:
    """N spawned load-generator processes sending to one OpenAI-compatible endpoint; `run` plays
    one run's schedule across them. Use as a context manager: the workers stop at its end."""

    def __init__(self, count: int, backend: OpenAIBackend):
        context = multiprocessing.get_context("spawn")  # no forked copy of the parent's loop and sockets
        self.pipes, self.procs = [], []
        for i in range(count):
            parent_end, worker_end = context.Pipe()
            proc = context.Process(
                target=_worker_main,
                name=f"bench-client-{i}",
                daemon=True,
                args=(worker_end, backend.base_url, backend.model, backend.api_key),
            )
            proc.start()
            worker_end.close()  # the worker holds its own copy: a dead worker reads as EOF here
            self.pipes.append(parent_end)
            self.procs.append(proc)

    def __enter__(self) -> ClientWorkers:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def run(
        self,
        prompts: list[list[int]],
        output_len: int | list[int],
        rate: float,
        max_concurrency: int,
        seed: int,
        timeout_s: float,
    ) -> tuple[list[RequestResult], float, float]:
        """(results in prompt order, duration from the common start to the last answer, the
        workers' CPU seconds summed). Uses at most max_concurrency workers, so each has a slot.
        output_len: one for every request, or each request's (a list parallel to prompts)."""
        offsets = arrival_times(len(prompts), rate, seed)
        output_lens = per_request(output_len, len(prompts))
        n = min(len(self.pipes), len(prompts), max_concurrency or len(self.pipes))
        pipes = self.pipes[:n]
        encoder = msgspec.msgpack.Encoder()
        for i, (pipe, share) in enumerate(zip(pipes, split_concurrency(max_concurrency, n))):
            pipe.send_bytes(encoder.encode(Job(prompts[i::n], offsets[i::n], output_lens[i::n], share, timeout_s)))
        for i in range(n):
            self._receive(i)  # READY
        start = encoder.encode(Start(time.time() + START_MARGIN_S))
        for pipe in pipes:
            pipe.send_bytes(start)
        decoder = msgspec.msgpack.Decoder(Done)
        done = [decoder.decode(self._receive(i)) for i in range(n)]
        results: list[RequestResult] = [None] * len(prompts)  # type: ignore[list-item]
        for i, share in enumerate(done):
            results[i::n] = share.results
        return results, max(d.last_answer_s for d in done), sum(d.cpu_s for d in done)

    def _receive(self, i: int) -> bytes:
        try:
            return self.pipes[i].recv_bytes()
        except EOFError:
            self.procs[i].join(1.0)
            raise RuntimeError(
                f"client worker {i} exited (code {self.procs[i].exitcode}); its traceback is on stderr"
            ) from None

    def close(self) -> None:
        for pipe in self.pipes:
            try:
                pipe.send_bytes(STOP)
            except OSError:  # already gone
                pass
        for proc in self.procs:
            proc.join(STOP_TIMEOUT_S)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for pipe in self.pipes:
            pipe.close()


def _worker_main(pipe, base_url: str, model: str, api_key: str) -> None:
    """A client worker: plays each Job it is sent, from the Start it is given, until STOP."""
    backend = OpenAIBackend(base_url, model, api_key)
    tune_gc()
    jobs, starts, encoder = msgspec.msgpack.Decoder(Job), msgspec.msgpack.Decoder(Start), msgspec.msgpack.Encoder()
    try:
        while (message := pipe.recv_bytes()) != STOP:
            cpu = time.process_time()
            job = jobs.decode(message)
            pipe.send_bytes(READY)
            start_wall = starts.decode(pipe.recv_bytes()).wall_time
            # NOTE: the wall clock only places the common start; times within the run are this
            # process's perf_counter, as in a single-process run.
            start = time.perf_counter() + (start_wall - time.time())
            results = asyncio.run(
                send_on_schedule(
                    backend, job.prompts, job.offsets, job.output_lens, job.max_concurrency, job.timeout_s, start
                )
            )
            last_answer_s = time.perf_counter() - start
            pipe.send_bytes(encoder.encode(Done(results, last_answer_s, time.process_time() - cpu)))
    except (EOFError, KeyboardInterrupt):  # the parent went away, or Ctrl-C reached the whole group
        pass
