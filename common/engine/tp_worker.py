"""A TP engine's ranks 1..N-1 (SGLang's TP worker pattern): each holds its shard of the model and its
KV heads and runs, for every batch rank 0 launches, the same device writes and the same forward.

    rank 0, the engine (schedules, samples, talks to the frontend):
        TPWorkers.start(config, kv=)    spawn ranks 1..N-1 and meet them (a TCPStore on a free port)
        workers.send(plan, slots)       per launch, before its own: the BatchPlan, as plain data
        workers.send_to / broadcast     a server's KV orders; host_copy: its host KV tier's (tp_messages.py)
        workers.take(kind)              what the ranks reported (pool metadata, WRITEs ended, notifications)
        workers.close()                 stop them
    rank r (`python -m pdserve.common.engine.tp_worker`):
        follow(runner, builder, recv)   apply each plan on the schedule stream, launch_replica on
                                        the forward stream, WAR barrier: rank 0's loop minus the host;
                                        rank 0's host-tier copies; a server's KV duty (rank_duty.py)

The messages travel over one ipc:// pyzmq PUSH -> PULL socket per rank (and one back to rank 0 for a
server's ranks), msgspec-encoded (numpy arrays as raw bytes, no pickle); the forwards' collectives meet
through torch.distributed (tp.py). Rank 0's token ids reach the other ranks' FutureMaps by a broadcast
inside the forward (ModelRunner), so a later plan's placeholders resolve the same on every rank.

Failure: rank 0 checks that every rank is alive before each send (and, in a server, every
ALIVE_PERIOD_S when idle) and raises (after killing the rest) when one is not; a rank whose rank 0
is gone (its parent process changed) exits within a second; a collective with a dead peer fails at
once on gloo, and after --dist-timeout at worst.
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
from dataclasses import dataclass

import zmq

from pdserve.common import stacks
from pdserve.common.config import EngineConfig
from pdserve.common.engine import tp_messages
from pdserve.common.engine.batch import BatchPlan
from pdserve.common.engine.tp_messages import RankReady, Step, Stop
from pdserve.common.kv_transfer.base import KVSide
from pdserve.common.lifetime import die_with_parent
from pdserve.common.ports import free_port

log = logging.getLogger(__name__)

PARENT_POLL_MS = 1000  # how often an idle rank checks that rank 0 is still there
DUTY_POLL_MS = 1  # how often a rank with KV transfers open polls its agent while no step comes
ALIVE_PERIOD_S = 0.2  # how often an idle server's rank 0 checks that the other ranks are alive
ALIVE_CHECK_S = 0.01  # how often rank 0, waiting for a result, checks that the other ranks are alive
ABORT_WAIT_S = 2  # how long rank 0's NCCL abort may wait for ranks that are gone (close(kill=True))
IN_FLIGHT = 3  # batches a rank keeps alive after launching them (rank 0 has at most two unprocessed)


_decoder, _encoder = tp_messages.to_rank_decoder, tp_messages.encoder


@dataclass(frozen=True)
class KVRanks:
    """A prefill or decode server's TP ranks each run a KV transfer agent on the server's side
    (common/kv_transfer/rank_duty.py), rank r's agent named f"{agent_name}.tp{r}"."""

    duty: KVSide
    agent_name: str
    path: str = "auto"  # a sender's --kv-transfer-path


class TPWorkers:
    """Rank 0's handle on ranks 1..N-1: their processes and the sockets that feed them."""

    def __init__(self, config: EngineConfig, procs, sockets, ctx, run_dir: str, group):
        self.config, self.procs, self.sockets, self.ctx, self.run_dir = config, procs, sockets, ctx, run_dir
        self.group = group  # rank 0's TPGroup: the runner's collectives
        self.closed = False
        self.reports = None  # PULL: what the ranks tell rank 0 (tp_messages.FromRank), with KVRanks
        self._inbox: dict[type, list] = {}  # reports received, by type, not yet taken
        self._next_alive_check = 0.0

    @classmethod
    def start(cls, config: EngineConfig, prefill_graphs: bool, kv: KVRanks | None = None) -> "TPWorkers":
        """Spawn ranks 1..N-1 and join the group with them (blocks until all are there). With `kv`
        each rank also runs a KV transfer agent and reports to rank 0 (`take`)."""
        import torch

        from pdserve.common.engine.tp import TPGroup, rank_device

        size, timeout, port = config.tp_size, config.dist_timeout, free_port()
        store = TPGroup.serve_store(size, port, timeout)  # listening before anyone connects
        run_dir, ctx, procs, sockets = tempfile.mkdtemp(prefix="pdserve-tp-"), zmq.Context(), [], []
        workers = cls(config, procs, sockets, ctx, run_dir, None)
        try:
            reports_endpoint = f"ipc://{run_dir}/reports"
            if kv is not None:
                workers.reports = ctx.socket(zmq.PULL)
                workers.reports.setsockopt(zmq.LINGER, 0)
                workers.reports.bind(reports_endpoint)
            for rank in range(1, size):
                sock = ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SNDTIMEO, int(timeout * 1000))
                endpoint = f"ipc://{run_dir}/rank-{rank}"
                sock.bind(endpoint)
                sockets.append(sock)
                args = {
                    "config": dataclasses.asdict(config),
                    "rank": rank,
                    "store_port": port,
                    "endpoint": endpoint,
                    "parent": os.getpid(),
                    "prefill_graphs": prefill_graphs,
                    "threads": torch.get_num_threads(),
                    "log_level": logging.getLogger().getEffectiveLevel(),
                    "kv": dataclasses.asdict(kv) if kv is not None else None,
                    "reports": reports_endpoint,
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
        self.broadcast(Step.of(plan, slots))

    def broadcast(self, msg) -> None:
        """`msg` (tp_messages.ToRank) to every other rank, after what was sent before."""
        data = _encoder.encode(msg)
        for rank in range(1, len(self.sockets) + 1):
            self._send(rank, data)

    def host_copy(self, op: str, pages: list[int], slots: list[int]) -> None:
        """Rank 0's host KV tier copies these pages (HostKVPool's `mirror`): every rank copies its heads."""
        self.broadcast(tp_messages.HostCopy(op, pages, slots))

    def send_to(self, rank: int, msg) -> None:
        self._send(rank, _encoder.encode(msg))

    def _send(self, rank: int, data: bytes) -> None:
        try:
            self.sockets[rank - 1].send(data)
        except zmq.Again:
            self.close(kill=True)
            raise RuntimeError(f"TP rank {rank} took no message for {self.config.dist_timeout}s") from None

    def take(self, kind: type) -> list:
        """The reports of type `kind` received since the last call; never blocks."""
        while True:
            try:
                msg = tp_messages.from_rank_decoder.decode(self.reports.recv(zmq.NOBLOCK))
            except zmq.Again:
                break
            self._inbox.setdefault(type(msg), []).append(msg)
        return self._inbox.pop(kind, [])

    def wait_for(self, kind: type, count: int, what: str, timeout_s: float | None = None) -> list:
        """`count` reports of type `kind` (those already taken excluded), waiting at most
        `timeout_s` (default --dist-timeout) and failing at once if a rank dies meanwhile."""
        deadline = time.monotonic() + (self.config.dist_timeout if timeout_s is None else timeout_s)
        got = []
        while True:
            got += self.take(kind)
            if len(got) >= count:
                return got
            self.check_alive()
            if time.monotonic() > deadline:
                raise RuntimeError(f"TP ranks sent {len(got)} of {count} {what} within the timeout")
            self.reports.poll(10)

    def rank_pools(self) -> list[bytes]:
        """Ranks 1..N-1's pool metadata, by rank (each rank sends it once its pool is up)."""
        ready = self.wait_for(RankReady, len(self.procs), "KV pool announcements")
        return [r.metadata for r in sorted(ready, key=lambda r: r.rank)]

    def check_alive_now_and_then(self, now: float) -> None:
        """check_alive, at most every ALIVE_PERIOD_S: an idle server notices a dead rank too."""
        if now >= self._next_alive_check:
            self._next_alive_check = now + ALIVE_PERIOD_S
            self.check_alive()

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

    def check_alive(self, grace_s: float = 0.0) -> None:
        """RuntimeError (the others killed) when a rank has exited; looked for `grace_s` (core.py DEAD_PEER_GRACE_S)."""
        deadline = time.monotonic() + grace_s
        while True:
            for rank, proc in enumerate(self.procs, start=1):
                if (code := proc.poll()) is not None:
                    self.close(kill=True)
                    raise RuntimeError(f"TP rank {rank} exited with code {code}")
            if time.monotonic() >= deadline:
                return
            time.sleep(0.01)

    def close(self, kill: bool = False) -> None:
        """Stop every other rank (kill: at once; else they finish what they were sent, then exit).

        NOTE NCCL (two H200s): a communicator must be ended by every rank together, while all are
        alive. A rank that exited without it left rank 0's ProcessGroupNCCL to hang in its
        destructor: when the group was dropped (a second TP engine in the same process hung at
        start-up) or at exit, and `abort()` on rank 0 alone hung too. So on Stop each rank frees its
        CUDA graphs and shuts its communicator down, and rank 0 does the same here (the engine
        freed its graphs first). With `kill` no rank is left to meet, so rank 0's communicator is
        aborted on a best-effort basis."""
        if self.closed:
            return
        self.closed = True
        if kill and self.group is not None:
            # NOTE ProcessGroupNCCL.abort waits for the peers up to the group's timeout (two H200s: a
            # TP server whose rank 1 was SIGKILLed sat 120 s in it, --dist-timeout), and past it: bounded.
            self.group.abort(ABORT_WAIT_S)
        stopped = []
        for rank, sock in enumerate(self.sockets, start=1):
            if not kill:
                try:
                    sock.send(_encoder.encode(Stop()), zmq.NOBLOCK)
                    stopped.append(rank)
                except zmq.ZMQError:
                    pass
        if not kill and self.group is not None and len(stopped) == len(self.sockets) and self._all_alive():
            self.group.shutdown()  # alongside every rank's own (main, once follow() returns)
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
        if self.reports is not None:
            self.reports.close()
        self.ctx.term()
        shutil.rmtree(self.run_dir, ignore_errors=True)
        self.group = None

    def _all_alive(self) -> bool:
        return all(proc.poll() is None for proc in self.procs)


# ---- ranks 1..N-1 -------------------------------------------------------------------------------


def follow(runner, builder, recv, duty=None) -> bool:
    """Run every step rank 0 sends, as its loop launches them: the device writes on the schedule
    stream, the forward on the forward stream (waiting for them), then the WAR barrier, so the
    next plan's writes wait for this forward on the device. The host never waits except to bound
    the batches it keeps alive. Any other message goes to the rank's KV `duty`, with the event of
    the last forward launched before it (a WRITE it orders reads that forward's KV). True when
    rank 0 sent Stop, False when rank 0 is gone."""
    streams = runner.streams
    schedule_stream, forward_stream = streams.schedule_stream, streams.forward_stream
    in_flight: deque = deque()
    last_done = None
    while True:
        msg = recv()
        if msg is None or isinstance(msg, Stop):
            for done, _ in in_flight:
                done.synchronize()
            return msg is not None
        if isinstance(msg, Step):
            with streams.use(schedule_stream):
                batch = builder.apply(msg.plan())
                last_done = runner.launch_replica(batch, msg.slots)
                schedule_stream.wait_stream(forward_stream)  # WAR barrier
            in_flight.append((last_done, batch))  # its tensors stay alive until the device is done with them
            if len(in_flight) > IN_FLIGHT:
                in_flight.popleft()[0].synchronize()
        elif isinstance(msg, tp_messages.HostCopy):  # where rank 0's scheduling copied: its stream
            with streams.use(schedule_stream):
                runner.kv_pool.host_tier.replay(runner.kv_pool, msg.op, msg.pages, msg.slots)
        else:
            duty.handle(msg, last_done)
        if duty is not None:
            duty.poll()


def _receiver(sock, parent: int, duty=None):
    """recv() for `follow`: the next message (Stop included), or None when rank 0 is gone. While it
    waits, a duty with transfers open is polled every DUTY_POLL_MS."""

    def recv():
        next_parent_check = time.monotonic() + PARENT_POLL_MS / 1000
        while not sock.poll(DUTY_POLL_MS if duty is not None and duty.active else PARENT_POLL_MS):
            if duty is not None:
                duty.poll()
            if time.monotonic() >= next_parent_check:
                next_parent_check = time.monotonic() + PARENT_POLL_MS / 1000
                if os.getppid() != parent:
                    log.error("rank 0 (process %d) is gone; exiting", parent)
                    return None
        return _decoder.decode(sock.recv())

    return recv


def _kv_duty(kv: dict, rank: int, runner, ctx, reports_endpoint: str):
    """This rank's agent and duty (rank_duty.py), its pool announced to rank 0."""
    from pdserve.common.kv_transfer.nixl_agent import NixlKVAgent
    from pdserve.common.kv_transfer.pool_metadata import encode_pool_metadata
    from pdserve.common.kv_transfer.rank_duty import ReceiverDuty, SenderDuty

    out = ctx.socket(zmq.PUSH)
    # NOTE: linger, so the last reports leave before the socket closes (a closing PUSH drops them).
    out.setsockopt(zmq.LINGER, 2000)
    out.connect(reports_endpoint)
    agent = NixlKVAgent(f"{kv['agent_name']}.tp{rank}", runner.kv_pool, path=kv.get("path", "auto"))

    def report(msg) -> None:
        out.send(_encoder.encode(msg))

    report(RankReady(rank, encode_pool_metadata([agent.metadata()])))
    duty = (SenderDuty if KVSide(kv["duty"]) is KVSide.SENDER else ReceiverDuty)(rank, agent, report)
    return duty, agent, out


def main(argv: list[str]) -> int:
    args = json.loads(argv[0])
    rank = args["rank"]
    logging.basicConfig(level=args["log_level"], format=f"%(asctime)s %(levelname)s tp rank {rank}: %(message)s")
    stacks.dump_on_signal()  # `kill -USR1`: every thread's stack to the log (common/stacks.py)
    import torch

    from pdserve.common.engine.batch_builder import BatchBuilder
    from pdserve.common.engine.model_runner import ModelRunner
    from pdserve.common.engine.tp import TPGroup, rank_device

    die_with_parent(args["parent"])  # even when stuck in a collective
    config = EngineConfig(**args["config"])
    torch.set_num_threads(args["threads"])
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(args["endpoint"])
    closers = []
    try:
        group = TPGroup.join(
            rank, config.tp_size, rank_device(config.device, rank), args["store_port"], config.dist_timeout
        )
        # The same start-up as rank 0's engine (EngineCore.__init__), step for step: the runner (KV sizing
        # and graph capture are collectives), the KV agent, then the warm-up. NOTE the agent before the
        # warm-up: rank 0 waits for every rank's pool (its scheduler) before it warms up, so a rank warming
        # up first waits in the warm-up's collectives for a rank 0 that waits for it (a deadlock on CUDA).
        side = KVSide(args["kv"]["duty"]) if args["kv"] else None  # (a decode server's: its request rows)
        runner, duty = ModelRunner(config, prefill_graphs=args["prefill_graphs"], tp=group, kv_side=side), None
        if args["kv"] is not None:
            duty, agent, out = _kv_duty(args["kv"], rank, runner, ctx, args["reports"])
            closers += [agent.close, out.close]
        if runner.device.type == "cuda":
            runner.warmup(config.chunked_prefill_size if config.chunked_prefill_size > 0 else 8192)
        builder = BatchBuilder(runner.req_to_token_pool, config.page_size)
        stopped = follow(runner, builder, _receiver(sock, args["parent"], duty), duty)
        if stopped:  # rank 0 shuts its communicator down alongside (TPWorkers.close)
            runner.release_graphs()
            group.shutdown()
    except Exception:  # noqa: BLE001 - report; rank 0 sees the process end
        log.error("failed:\n%s", traceback.format_exc())
        return 1
    finally:
        for close in reversed(closers):
            close()
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
