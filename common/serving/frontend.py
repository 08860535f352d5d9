"""What both server frontends share: the bridge to the scheduler process, health,
conversions from the proto, and the serve-until-SIGTERM lifecycle.

The frontend never touches the device: it validates, forwards typed messages to its scheduler
process, and routes the answers back to the waiting RPCs by request id.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import shutil
import signal
import sys
import tempfile
import time

import grpc
import zmq
import zmq.asyncio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import start_http_server

from pdserve.common import stacks
from pdserve.common.errors import ErrorCode, StartupFailed
from pdserve.common.gc_tuning import tune_gc
from pdserve.common.server_config import ServerConfig
from pdserve.common.serving import ipc
from pdserve.common.serving.request_spans import Arrival, record_decode, record_prefill
from pdserve.common.serving.server_metrics import Metrics
from pdserve.common.startup import process_age
from pdserve.common.trust import add_port, check_exposure, load_trust, server_interceptors
from pdserve.proto import pdserve_pb2 as pb

log = logging.getLogger(__name__)

# Traced requests kept after their caller let go, until their last message: the newest this many.
MAX_ENDING = 4096
# How long a scheduler that missed its start-up deadline gets to write its threads' stacks before it
# is stopped (faulthandler writes them from the signal handler at once: this is for the pipe).
STACK_DUMP_WAIT_S = 1.0


class SchedulerBridge:
    """The scheduler process and the two ipc channels to it; routes its messages by request id."""

    def __init__(self, target, args: tuple, metrics: Metrics, tracer=None):
        self.run_dir = tempfile.mkdtemp(prefix="pdserve-ipc-")
        self.to_scheduler, self.to_frontend = ipc.ipc_paths(self.run_dir)
        self.ctx = zmq.asyncio.Context()
        self.outbox = self.ctx.socket(zmq.PUSH)
        self.outbox.setsockopt(zmq.LINGER, ipc.LINGER_MS)
        self.outbox.bind(self.to_scheduler)
        self.inbox = self.ctx.socket(zmq.PULL)
        self.inbox.setsockopt(zmq.LINGER, ipc.LINGER_MS)
        self.inbox.bind(self.to_frontend)
        # spawn: the scheduler must not inherit this process's threads or gRPC state; the args
        # cross a local pipe to the child, never a TCP socket.
        self.process = multiprocessing.get_context("spawn").Process(
            target=target, args=(*args, self.to_scheduler, self.to_frontend), daemon=True
        )
        self.metrics = metrics
        self.tracer = tracer  # common/tracing.py Tracer; None: not tracing
        self.arrivals: dict[str, Arrival] = {}  # traced requests in flight
        self.ending: dict[str, Arrival] = {}  # traced requests unsubscribed before their last message, oldest first
        self.queues: dict[str, asyncio.Queue] = {}
        self.ready: asyncio.Future | None = None
        self.bye = asyncio.Event()
        self.load = ipc.LoadReport(0, 0, 0, 0, 0)

    async def start(self, timeout_s: float) -> ipc.Ready:
        """The scheduler's Ready, or StartupFailed: it exited first, or was not ready in `timeout_s`
        (its threads' stacks are then in the log first: common/stacks.py)."""
        self.ready = asyncio.get_running_loop().create_future()
        self.process.start()
        self._reader = asyncio.create_task(self._read())
        self._watch = asyncio.create_task(self._watch_process())
        try:
            return await asyncio.wait_for(self.ready, timeout_s)
        except asyncio.TimeoutError:
            pid = self.process.pid
            dumped = stacks.ask_for_stacks(pid)
            if dumped:
                await asyncio.sleep(STACK_DUMP_WAIT_S)
            where = "; the stacks of its threads are above" if dumped else ""
            raise StartupFailed(
                f"the scheduler process (pid {pid}) was not ready within --startup-timeout {timeout_s:g} s{where}"
            ) from None

    def subscribe(self, rid: str, queue: asyncio.Queue | None = None, trace_context=None) -> asyncio.Queue:
        """The queue `rid`'s messages will arrive on: a new one, or `queue` (several requests may
        share one; every message names its request). `trace_context`: the request's (when tracing,
        its spans go under it: common/serving/request_spans.py)."""
        if rid in self.queues:
            raise ValueError(f"request id {rid!r} is already in flight")
        queue = self.queues[rid] = asyncio.Queue() if queue is None else queue
        if self.tracer is not None:
            self.arrivals[rid] = Arrival(self.tracer.context_of(trace_context or {}), time.time_ns())
        return queue

    def unsubscribe(self, rid: str) -> None:
        self.queues.pop(rid, None)
        arrival = self.arrivals.pop(rid, None)
        if arrival is not None:  # (its spans once its last message comes: _read)
            self.ending[rid] = arrival
            if len(self.ending) > MAX_ENDING:
                del self.ending[next(iter(self.ending))]

    async def send(self, msg) -> None:
        await self.outbox.send(ipc.encode(msg))

    async def _read(self) -> None:
        while True:
            msg = ipc.decode_to_frontend(await self.inbox.recv())
            if isinstance(msg, ipc.Ready):
                self.ready.set_result(msg)
            elif isinstance(msg, ipc.LoadReport):
                self.load = msg
                self.metrics.update(msg)
            elif isinstance(msg, ipc.Bye):
                self.bye.set()
            elif isinstance(msg, ipc.TransfersRejected):
                for reason, count in msg.counts.items():
                    self.metrics.rejected_transfers.labels(self.metrics.role, reason).inc(count)
            elif isinstance(msg, ipc.PrefillDone | ipc.Finished) and msg.rid not in self.queues:
                self._ended(msg)  # the caller let go first (a router ends a choice on its last token)
            elif isinstance(msg, ipc.StepTokens):
                for chunk in msg.chunks:
                    queue = self.queues.get(chunk.rid)
                    if queue is not None:
                        queue.put_nowait(chunk)
            elif msg.rid in self.queues:
                if isinstance(msg, ipc.Destination):
                    self.metrics.transfer_prefix_hit_tokens.inc(msg.prefix_len)
                elif isinstance(msg, ipc.PrefillDone) and msg.error is None:
                    self.metrics.observe_prefill(msg)
                elif (
                    isinstance(msg, ipc.PrefillDone | ipc.Finished)
                    and msg.error_code
                    and msg.error_code.is_transfer_failure
                ):
                    self.metrics.transfer_failures.inc()
                if isinstance(msg, ipc.PrefillDone | ipc.Finished):
                    self._ended(msg)
                self.queues[msg.rid].put_nowait(msg)

    def _ended(self, msg: ipc.PrefillDone | ipc.Finished) -> None:
        """A request's last message: its stages, into the histograms and (traced) its spans."""
        self.metrics.observe_stages(msg)
        arrival = self.arrivals.pop(msg.rid, None) or self.ending.pop(msg.rid, None)
        if arrival is None:
            return
        record = record_prefill if isinstance(msg, ipc.PrefillDone) else record_decode
        try:
            record(self.tracer, arrival, msg)
        except Exception:  # a span is never worth a request: logged, and the request goes on
            log.exception("could not record the spans of request %s", msg.rid)

    async def _watch_process(self) -> None:
        """If the scheduler dies, fail everything waiting on it rather than hang."""
        while self.process.is_alive():
            await asyncio.sleep(0.2)
        if not self.bye.is_set():
            log.error("the scheduler process exited (code %s)", self.process.exitcode)
        if self.ready is not None and not self.ready.done():
            self.ready.set_exception(StartupFailed(f"scheduler exited with code {self.process.exitcode} before ready"))
        for rid, queue in self.queues.items():
            queue.put_nowait(ipc.Rejected(rid, "the scheduler process exited", code=ErrorCode.INTERNAL))
        self.bye.set()

    async def close(self) -> None:
        for task in (getattr(self, "_reader", None), getattr(self, "_watch", None)):
            if task is not None:
                task.cancel()
        self.outbox.close()
        self.inbox.close()
        self.ctx.term()
        if self.bye.is_set():  # it said goodbye: let it exit by itself (its atexit hooks free shared memory)
            self.process.join(10)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(10)
        if self.process.is_alive():  # stuck in native code: SIGTERM's handler never runs
            self.process.kill()
            self.process.join(10)
        shutil.rmtree(self.run_dir, ignore_errors=True)  # the two ipc sockets' files


class CommonRpcs:
    """The RPCs both services answer the same way."""

    role = pb.ServerInfo.ROLE_UNSPECIFIED

    def __init__(self, bridge: SchedulerBridge, ready: ipc.Ready):
        self.bridge, self.ready, self.draining = bridge, ready, False

    async def Abort(self, request, context):
        found = request.request_id in self.bridge.queues
        if found:
            await self.bridge.send(ipc.Abort(request.request_id))
        return pb.AbortResponse(found=found)

    async def GetLoad(self, request, context):
        load = self.bridge.load
        return pb.Load(
            running_requests=load.running,
            waiting_requests=load.waiting,
            kv_used_tokens=load.kv_used_tokens,
            kv_total_tokens=load.kv_total_tokens,
            inflight_transfers=load.inflight_transfers,
        )

    async def GetServerInfo(self, request, context):
        from importlib.metadata import PackageNotFoundError, version

        try:
            ver = version("pdserve")
        except PackageNotFoundError:
            ver = "dev"
        i = self.ready.info
        return pb.ServerInfo(
            role=self.role,
            model_path=i["model_path"],
            served_model_name=i["served_model_name"],
            architecture=i["architecture"],
            layout=layout_to_proto(self.ready.layout),
            context_length=i["context_length"],
            max_running_requests=i["max_running_requests"],
            max_total_tokens=i["max_total_tokens"],
            transfer_backend="nixl",
            version=ver,
        )

    async def GetAgentMetadata(self, request, context):
        return pb.AgentMetadata(
            agent_name=self.ready.agent_name,
            metadata=self.ready.agent_metadata,
            layout=layout_to_proto(self.ready.layout),
        )


def ready_message(engine) -> ipc.Ready:
    """What a scheduler announces once its engine is up (both roles): its agent name and metadata
    (every TP rank's pool) and its layout (every KV head of the model)."""
    kv, c = engine.kv, engine.config
    layout = {
        k: getattr(kv.layout, k) for k in ("page_size", "num_layers", "kv_heads", "head_dim", "dtype", "num_pages")
    }
    info = {
        "model_path": c.model_path,
        "served_model_name": c.served_model_name,
        "architecture": type(engine.runner.model).__name__,
        "context_length": c.context_length,
        "max_running_requests": c.max_running_requests,
        "max_total_tokens": engine.runner.kv_pool.capacity_tokens,
    }
    return ipc.Ready(agent_name=kv.name, agent_metadata=kv.encoded, layout=layout, info=info)


def params_from_proto(p: pb.SamplingParams) -> ipc.Params:
    return ipc.Params(
        max_new_tokens=p.max_new_tokens,
        min_new_tokens=p.min_new_tokens,
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        min_p=p.min_p,
        seed=p.seed if p.HasField("seed") else None,
        repetition_penalty=p.repetition_penalty,
        frequency_penalty=p.frequency_penalty,
        presence_penalty=p.presence_penalty,
        stop=tuple(p.stop),
        stop_token_ids=tuple(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        include_stop_str_in_output=p.include_stop_str_in_output,
        logprobs=p.logprobs if p.HasField("logprobs") else None,
        skip_special_tokens=p.skip_special_tokens,
        prompt_logprobs=p.prompt_logprobs if p.HasField("prompt_logprobs") else None,
        logit_bias=tuple((b.token_id, b.bias) for b in p.logit_bias),
        grammar=(p.grammar.kind, p.grammar.spec) if p.HasField("grammar") else None,
        resumed_output_tokens=p.resumed_output_tokens,
    )


def layout_to_proto(layout: dict) -> pb.KVLayout:
    return pb.KVLayout(**layout)


def logprob_to_proto(lp) -> pb.TokenLogprob | None:
    """(token id, logprob, top n) or, for a prompt token, (token id, logprob, top n, rank)."""
    if lp is None:
        return None
    token_id, logprob, top, *rank = lp
    out = pb.TokenLogprob(
        token_id=token_id, logprob=logprob, top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in top]
    )
    if rank:
        out.rank = rank[0]
    return out


def error_to_proto(code: ErrorCode | None, message: str) -> pb.Error:
    """The proto's Error; the enums share their names (tests/test_proto.py)."""
    return pb.Error(code=pb.Error.Code.Value((code or ErrorCode.INTERNAL).value), message=message)


async def serve(
    servicer_factory, add_servicer, bridge: SchedulerBridge, config: ServerConfig, service_name: str
) -> None:
    """Start the scheduler, then gRPC and metrics; on SIGTERM/SIGINT drain and exit."""
    host, port, metrics_port = config.host, config.port, config.metrics_port
    if metrics_port:
        start_http_server(metrics_port, addr=host, registry=bridge.metrics.registry)
    trust = load_trust(config)  # checked by the CLI before the scheduler was spawned
    warning = check_exposure(trust, [host], "listening on")
    if warning:
        log.warning("%s", warning)
    spawned_at = process_age()
    try:
        ready = await bridge.start(config.startup_timeout)
        server = grpc.aio.server(
            interceptors=server_interceptors(trust, lambda method: bridge.metrics.unauthenticated.inc())
        )
        servicer = servicer_factory(bridge, ready)
        add_servicer(servicer, server)
        health_servicer = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        bound = add_port(server, f"{host}:{port}", trust)
        if bound == 0:
            raise RuntimeError(f"cannot listen on {host}:{port}")
        await server.start()
        tune_gc()  # (the scheduler process tunes its own: the engine does)
        for name in ("", service_name):
            await _set_health(health_servicer, name, health_pb2.HealthCheckResponse.SERVING)
        log.info(
            "%s serving on %s:%d (metrics on %s; %s, %s)",
            service_name,
            host,
            port,
            metrics_port or "off",
            "mutual TLS" if trust.tls else "plaintext",
            "cluster secret required" if trust.secrets else "no secret",
        )
        # Printed, not logged (as the scheduler's phases are): where a slow start went, before the engine.
        print(
            f"{service_name} serving {process_age():.1f} s after its process began (its scheduler process "
            f"spawned at {spawned_at:.1f} s)",
            file=sys.stderr,
            flush=True,
        )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await asyncio.wait(
            [asyncio.create_task(stop.wait()), asyncio.create_task(bridge.bye.wait())],
            return_when=asyncio.FIRST_COMPLETED,
        )
        # Drain: stop admitting (health and the scheduler both say so), finish in-flight, exit.
        for name in ("", service_name):
            await _set_health(health_servicer, name, health_pb2.HealthCheckResponse.NOT_SERVING)
        servicer.draining = True
        if not bridge.bye.is_set():
            await bridge.send(ipc.Drain())
            try:
                await asyncio.wait_for(bridge.bye.wait(), config.drain_timeout)
            except asyncio.TimeoutError:
                log.warning("drain timed out after %ss", config.drain_timeout)
        await server.stop(grace=5)
    finally:  # a scheduler that failed to start is stopped too, and its ipc directory removed
        await bridge.close()


async def _set_health(servicer, name: str, status) -> None:
    result = servicer.set(name, status)
    if asyncio.iscoroutine(result):
        await result
