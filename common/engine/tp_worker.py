"""A TP engine's ranks 1..N-1 (SGLang's TP worker pattern): each holds its shard of the model and its
KV heads and runs, for every batch rank 0 launches, the same device writes and the same forward.

    rank 0, the engine (schedules, samples, talks to the frontend):
        TPWorkers.start(config)         spawn ranks 1..N-1 and meet them (a TCPStore on a free port)
        workers.send(plan, slots)       per launch, before its own: the BatchPlan, as plain data
        workers.close()                 stop them
    rank r (`python -m pdserve.common.engine.tp_worker`):
        follow(runner, builder, recv)   apply each plan on the schedule stream, launch_replica on
                                        the forward stream, WAR barrier: rank 0's loop minus the host

The plans travel over one ipc:// pyzmq PUSH -> PULL socket per rank, msgspec-encoded (numpy arrays
as raw bytes, no pickle); the forwards' collectives meet through torch.distributed (tp.py). Rank 0's
token ids reach the other ranks' FutureMaps by a broadcast inside the forward (ModelRunner), so
a later plan's placeholders resolve the same on every rank.

Failure: rank 0 checks that every rank is alive before each send and raises (after killing the
rest) when one is not; a rank whose rank 0 is gone (its parent process changed) exits within a
second; a collective with a dead peer fails at once on gloo, and after --dist-timeout at worst.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections import deque

import msgspec
import numpy as np
import zmq

from pdserve.common.config import EngineConfig
from pdserve.common.engine.batch import BatchPlan, ForwardMode
from pdserve.common.ports import free_port

log = logging.getLogger(__name__)

PARENT_POLL_MS = 1000  # how often an idle rank checks that rank 0 is still there
ALIVE_CHECK_S = 0.01  # how often rank 0, waiting for a result, checks that the other ranks are alive
IN_FLIGHT = 3  # batches a rank keeps alive after launching them (rank 0 has at most two unprocessed)


class Step(msgspec.Struct, tag=True, array_like=True):
    """One launch: a BatchPlan and the FutureMap slots its sampled ids go to."""

    mode: str
    packed: bytes  # int64
    num_tokens: int
    seq_lens: list[int]
    extend_lens: list[int]
    extend_starts: list[int]
    req_rows: list[int]
    samples: list[bool]
    has_placeholders: bool
    row_writes: bytes  # int64 [3, N]; empty: none
    seq: int
    first_slot: int

    @classmethod
    def of(cls, plan: BatchPlan, slots: list[int]) -> "Step":
        rw = plan.row_writes
        return cls(plan.mode.value, plan.packed.tobytes(), plan.num_tokens, plan.seq_lens, plan.extend_lens,
                   plan.extend_starts, plan.req_rows, plan.samples, plan.has_placeholders,
                   rw.tobytes() if rw is not None else b"", plan.seq, slots[0] if slots else 0)

    def plan(self) -> BatchPlan:
        mode = ForwardMode(self.mode)
        packed = np.frombuffer(self.packed, dtype=np.int64).copy()  # writable, as torch wants
        if mode is ForwardMode.DECODE:
            packed = packed.reshape(6, -1)
        rw = np.frombuffer(self.row_writes, dtype=np.int64).reshape(3, -1).copy() if self.row_writes else None
        return BatchPlan(mode, packed, self.num_tokens, self.seq_lens, self.extend_lens, self.extend_starts,
                         self.req_rows, self.samples, self.has_placeholders, rw, self.seq)

    @property
    def slots(self) -> list[int]:
        return list(range(self.first_slot, self.first_slot + len(self.req_rows)))


class Stop(msgspec.Struct, tag=True, array_like=True):
    """Rank 0 is closing: exit."""


_decoder = msgspec.msgpack.Decoder(Step | Stop)
_encoder = msgspec.msgpack.Encoder()


class TPWorkers:
    """Rank 0's handle on ranks 1..N-1: their processes and the sockets that feed them."""

    def __init__(self, config: EngineConfig, procs, sockets, ctx, run_dir: str, group):
        self.config, self.procs, self.sockets, self.ctx, self.run_dir = config, procs, sockets, ctx, run_dir
        self.group = group  # rank 0's TPGroup: the runner's collectives
        self.closed = False

    @classmethod
    def start(cls, config: EngineConfig, prefill_graphs: bool) -> "TPWorkers":
        """Spawn ranks 1..N-1 and join the group with them (blocks until all are there)."""
        import torch

        from pdserve.common.engine.tp import TPGroup, rank_device

        size, timeout = config.tp_size, config.dist_timeout
        port = free_port()
        store = TPGroup.serve_store(size, port, timeout)  # listening before anyone connects
        run_dir = tempfile.mkdtemp(prefix="pdserve-tp-")
        ctx = zmq.Context()
        procs, sockets = [], []
        workers = cls(config, procs, sockets, ctx, run_dir, None)
        try:
            for rank in range(1, size):
                sock = ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SNDTIMEO, int(timeout * 1000))
                endpoint = f"ipc://{run_dir}/rank-{rank}"
                sock.bind(endpoint)
                sockets.append(sock)
                args = {
                    "config": dataclasses.asdict(config), "rank": rank, "store_port": port, "endpoint": endpoint,
                    "parent": os.getpid(), "prefill_graphs": prefill_graphs, "threads": torch.get_num_threads(),
                    "log_level": logging.getLogger().getEffectiveLevel(),
                }
                procs.append(subprocess.Popen([sys.executable, "-m", __name__, json.dumps(args)]))
            workers.group = TPGroup.join(0, size, rank_device(config.device, 0), port, timeout, store=store)
        except BaseException:
            workers.close(kill=True)
            raise
        return workers

    def send(self, plan: BatchPlan, slots: list[int]) -> None:
        """Hand every other rank the batch rank 0 is about to launch."""
        self.check_alive()
        data = _encoder.encode(Step.of(plan, slots))
        for rank, sock in enumerate(self.sockets, start=1):
            try:
                sock.send(data)
            except zmq.Again:
                self.close(kill=True)
                raise RuntimeError(f"TP rank {rank} took no batch for {self.config.dist_timeout}s") from None

    def wait(self, event) -> None:
        """Rank 0's one host wait (a result's copy_done), checking the other ranks now and then.

        NOTE on CUDA a forward whose peer died never ends (its NCCL kernels wait for the peer), so a
        plain `synchronize()` would hang until the NCCL watchdog's --dist-timeout; spinning on
        `query()` costs what synchronize's own spin does. On CPU the event is done at once.
        """
        next_check = time.monotonic() + ALIVE_CHECK_S
        while not event.query():
            if time.monotonic() >= next_check:
                self.check_alive()
                next_check += ALIVE_CHECK_S

    def check_alive(self) -> None:
        """RuntimeError (the others killed) when a rank has exited: the engine cannot go on."""
        for rank, proc in enumerate(self.procs, start=1):
            code = proc.poll()
            if code is not None:
                self.close(kill=True)
                raise RuntimeError(f"TP rank {rank} exited with code {code}")

    def close(self, kill: bool = False) -> None:
        """Stop every other rank (kill: at once; else they finish what they were sent, then exit)."""
        if self.closed:
            return
        self.closed = True
        if kill and self.group is not None:
            try:
                self.group.backend.abort()  # NCCL: kernels waiting on a dead peer end (GPU run pending)
            except (AttributeError, RuntimeError):
                pass
        for sock in self.sockets:
            if not kill:
                try:
                    sock.send(_encoder.encode(Stop()), zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
        for proc in self.procs:
            if kill and proc.poll() is None:
                proc.kill()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for sock in self.sockets:
            sock.close()
        self.ctx.term()
        shutil.rmtree(self.run_dir, ignore_errors=True)
        self.group = None


# ---- ranks 1..N-1 -------------------------------------------------------------------------------


def follow(runner, builder, recv) -> None:
    """Run every step rank 0 sends, as its loop launches them: the device writes on the schedule
    stream, the forward on the forward stream (waiting for them), then the WAR barrier, so the
    next plan's writes wait for this forward on the device. The host never waits except to bound
    the batches it keeps alive."""
    streams = runner.streams
    schedule_stream, forward_stream = streams.schedule_stream, streams.forward_stream
    in_flight: deque = deque()
    while (step := recv()) is not None:
        with streams.use(schedule_stream):
            batch = builder.apply(step.plan())
            done = runner.launch_replica(batch, step.slots)
            schedule_stream.wait_stream(forward_stream)  # WAR barrier
        in_flight.append((done, batch))  # its tensors stay alive until the device is done with them
        if len(in_flight) > IN_FLIGHT:
            in_flight.popleft()[0].synchronize()


def _receiver(sock, parent: int):
    """recv() for `follow`: the next Step, or None on Stop or when rank 0 is gone."""

    def recv():
        while not sock.poll(PARENT_POLL_MS):
            if os.getppid() != parent:
                log.error("rank 0 (process %d) is gone; exiting", parent)
                return None
        msg = _decoder.decode(sock.recv())
        return msg if isinstance(msg, Step) else None

    return recv


def main(argv: list[str]) -> int:
    args = json.loads(argv[0])
    rank = args["rank"]
    logging.basicConfig(level=args["log_level"], format=f"%(asctime)s %(levelname)s tp rank {rank}: %(message)s")
    import torch

    from pdserve.common.engine.batch_builder import BatchBuilder
    from pdserve.common.engine.model_runner import ModelRunner
    from pdserve.common.engine.tp import TPGroup, rank_device

    config = EngineConfig(**args["config"])
    torch.set_num_threads(args["threads"])
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(args["endpoint"])
    try:
        group = TPGroup.join(rank, config.tp_size, rank_device(config.device, rank), args["store_port"], config.dist_timeout)
        # The same start-up as rank 0's engine, collective for collective (KV sizing, graph
        # capture, warm-up).
        runner = ModelRunner(config, prefill_graphs=args["prefill_graphs"], tp=group)
        if runner.device.type == "cuda":
            chunk = config.chunked_prefill_size
            runner.warmup(chunk if chunk > 0 else 8192)
        follow(runner, BatchBuilder(runner.req_to_token_pool, config.page_size), _receiver(sock, args["parent"]))
    except Exception:  # noqa: BLE001 - report; rank 0 sees the process end
        log.error("failed:\n%s", traceback.format_exc())
        return 1
    finally:
        sock.close()
        ctx.term()
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    # NOTE: no interpreter teardown: destroying the process group while a peer is already gone can
    # abort the process ("terminate called without an active exception").
    os._exit(code)
