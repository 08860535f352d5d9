"""Prefill and decode servers with tensor parallelism, and KV moved between different TP sizes.

Engine level (like test_disagg_engines.py): prefill and decode engines of TP 1 or 2 in this process
(rank 0; their other ranks are processes they spawn), KV moved by real NIXL (DRAM) WRITEs from
every prefill rank to the decode ranks holding its heads; greedy output equals transformers'.
Then the same through real servers and the router, with the official openai client, and the
failure cases: aborts leave every rank idle, a dead rank takes its server out of service, an
incompatible pairing is refused with a clear error. The planning and bookkeeping are tested
exactly without processes.
"""

import asyncio
import os
import random
import signal
import time

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.common.config import EngineConfig
from pdserve.common.engine.tp_messages import (
    AddPeers,
    CancelWrite,
    ForgetPeers,
    Probe,
    RankState,
    Watch,
    WriteEnded,
    WriteKV,
)
from pdserve.common.kv_transfer import KVLayout, TransferState, decode_notif, encode_notif
from pdserve.common.kv_transfer.base import KVTransferError, TransferHandle
from pdserve.common.kv_transfer.pool_metadata import PoolMetadata, decode_pool_metadata, encode_pool_metadata
from pdserve.common.kv_transfer.rank_duty import ReceiverDuty, SenderDuty
from pdserve.common.kv_transfer.sender import KVSender
from pdserve.common.kv_transfer.server import ServerKV
from pdserve.common.kv_transfer.tp_plan import Write, plan_writes
from pdserve.common.tiny_model import make_tiny_model
from pdserve.common.types import FinishReason, SamplingParams
from pdserve.decode.arrivals import KVArrivals, Refused
from pdserve.decode.engine import DecodeEngine
from pdserve.prefill.engine import PrefillEngine
from tests.router_stack import RouterProcess
from tests.test_disagg_engines import Stepper, drive, hf_greedy, make_prompts
from tests.test_servers import Server, wait_idle

BASE = dict(device="cpu", max_total_tokens=4096, page_size=4, max_running_requests=8)
_names = iter(range(10**6))


@pytest.fixture(scope="module")
def kv1_model(tmp_path_factory):
    """A llama with one KV head: with TP 2 both ranks hold it (replicated)."""
    return str(make_tiny_model(tmp_path_factory.mktemp("kv1") / "llama", "llama", 0, {"num_key_value_heads": 1}))


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread in this process, so in every rank it spawns (they copy rank 0's count).

    NOTE on a 2-core box, processes with a thread per core that meet in every forward's
    collectives slow each other down ~30x (a colocated TP 2 engine, 4 x 30 tokens: 17 s with 2
    threads each, 0.6 s with 1)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def engines(tiny_models, kv1_model, one_thread):
    """(model, role, tp) -> engine, each started once; at the end every one must be idle on every rank."""
    paths = {"llama": tiny_models("llama"), "kv1": kv1_model}
    made = {}

    def get(model: str, role: str, tp: int):
        key = (model, role, tp)
        if key not in made:
            config = EngineConfig(
                model_path=paths[model],
                tp_size=tp,
                **BASE,
                **(dict(chunked_prefill_size=16) if role == "prefill" else {}),
            )
            cls = PrefillEngine if role == "prefill" else DecodeEngine
            made[key] = cls(config, f"{role}-tp{tp}-{model}-{next(_names)}", kv_transfer_timeout=30.0)
        return made[key]

    get.paths = paths
    yield get
    problems = []
    for key, engine in made.items():
        if not engine.is_idle():
            problems.append(f"{key} leaked KV: {engine.stats()}")
        if any(engine.ranks_open_transfers()):
            problems.append(f"{key} has transfers open on its other ranks: {engine.ranks_open_transfers()}")
        procs = engine.tp_workers.procs if engine.tp_workers else []
        engine.close()
        if any(p.poll() is None for p in procs):
            problems.append(f"{key}: a TP rank outlived its engine")
    assert problems == []


def greedy(n, max_new):
    return [SamplingParams(max_new_tokens=max_new, temperature=0)] * n


@pytest.mark.parametrize(
    "model, prefill_tp, decode_tp",
    [
        ("llama", 1, 2),
        ("llama", 2, 1),
        ("llama", 2, 2),
        ("kv1", 1, 2),
        ("kv1", 2, 2),
    ],
)
def test_greedy_across_tp_sizes_matches_transformers(engines, model, prefill_tp, decode_tp):
    prefill, decode = engines(model, "prefill", prefill_tp), engines(model, "decode", decode_tp)
    prompts = make_prompts(8, seed=prefill_tp * 10 + decode_tp)
    expected = hf_greedy(engines.paths[model], prompts, 10)
    completions, results = drive(prefill, decode, prompts, greedy(len(prompts), 10))
    assert [completions[f"r{i}"].output_ids for i in range(len(prompts))] == expected
    layout = decode.kv.layout  # every KV head of the model, counted once per decode rank holding it
    copies = sum(p.layout.kv_heads for p in decode.kv.pools) / layout.kv_heads
    for i, ids in enumerate(prompts):
        r = results[f"r{i}"]
        assert r.error is None and r.first_token == expected[i][0]
        assert r.transfer_bytes == copies * layout.transfer_bytes(-(-len(ids) // layout.page_size))
    assert prefill.is_idle() and decode.is_idle()
    assert prefill.ranks_open_transfers() == [0] * (prefill_tp - 1)


def test_each_rank_holds_and_publishes_its_own_heads(engines):
    decode = engines("llama", "decode", 2)
    pools = decode_pool_metadata(decode.kv.encoded)
    assert [p.name for p in pools] == [decode.kv.name, f"{decode.kv.name}.tp1"]
    assert [p.layout.heads for p in pools] == [range(0, 1), range(1, 2)]
    assert decode.kv.layout.kv_heads == 2 and decode.kv.layout.heads == range(0, 2)  # what ServerInfo says
    kv1 = decode_pool_metadata(engines("kv1", "decode", 2).kv.encoded)
    assert [p.layout.heads for p in kv1] == [range(0, 1), range(0, 1)]  # replicated


def test_aborts_at_every_stage_leave_every_rank_idle(engines):
    prefill, decode = engines("llama", "prefill", 2), engines("llama", "decode", 2)
    params = SamplingParams(max_new_tokens=30, ignore_eos=True, temperature=0)
    prompts = make_prompts(4, seed=11)
    rng = random.Random(3)
    for i, ids in enumerate(prompts):
        decode.add_decode_request(ids, params, room=rng.getrandbits(63), rid=f"a{i}")
    d_loop, p_loop = Stepper(decode), Stepper(prefill)
    d_loop.step()
    dests = {d.rid: d for d in decode.destinations}
    decode.destinations.clear()
    # a0: aborted on decode before its KV came; the prefill still WRITEs on both ranks, and the
    # pages stay held until both ranks' WRITEs have landed.
    assert decode.abort("a0").finish_reason is FinishReason.ABORT
    assert decode.stats()["kv_used_tokens"] > 0
    for i, ids in enumerate(prompts):
        d = dests[f"a{i}"]
        prefill.add_prefill_request(
            ids, params, d.room, d.agent_metadata, d.page_ids, rid=d.rid, expires_unix_s=d.expires_unix_s
        )
    # a1: aborted on prefill while queued, and on decode (a client disconnect cancels both).
    assert prefill.abort("a1").error == "aborted"
    decode.abort("a1")
    deadline, aborted = time.monotonic() + 60, set()
    while d_loop.busy() or p_loop.busy():
        assert time.monotonic() < deadline, (decode.stats(), prefill.stats())
        p_loop.step()
        transferring = {t.req.rid for t in prefill.scheduler.transfers}
        if "a2" in transferring and "a2" not in aborted:  # a2: aborted on both while its WRITEs run
            aborted.add("a2")
            prefill.abort("a2")
            decode.abort("a2")
        done = {c.rid: c for c in d_loop.step()}
        running = {r.rid: r for r in decode.scheduler.running}
        if "a3" in running and len(running["a3"].output_ids) >= 3 and "a3" not in aborted:  # a3: while decoding
            aborted.add("a3")
            decode.abort("a3")
        assert "a3" not in done or done["a3"].finish_reason is FinishReason.ABORT
        if [r.rid for r in decode.scheduler.transferring.values()] == ["a1"] and not p_loop.busy():
            decode.scheduler.expire_transfers(time.monotonic() + 3600)  # a1's KV never comes: past the grace
    assert aborted == {"a2", "a3"}
    assert decode.is_idle() and prefill.is_idle() and decode.stats()["kv_used_tokens"] == 0
    assert prefill.scheduler.kv_used_tokens() == 0
    assert prefill.ranks_open_transfers() == [0] and decode.ranks_open_transfers() == [0]


def test_an_incompatible_pairing_is_refused_with_a_clear_error(engines, tiny_models):
    prefill, decode = engines("llama", "prefill", 2), engines("kv1", "decode", 2)
    decode.add_decode_request([0, 5, 6, 7], SamplingParams(max_new_tokens=2), room=77, rid="mismatch")
    decode.pop_preallocated()
    [d] = decode.destinations
    decode.destinations.clear()
    with pytest.raises(
        ValueError,
        match=r"KV layout of '.*' \(rank 0 of 2 of server .*\) is incompatible with this "
        r"server's: model_kv_heads 2 here vs 1 at the peer",
    ):
        prefill.add_prefill_request([0, 5, 6, 7], SamplingParams(max_new_tokens=2), 77, d.agent_metadata, d.page_ids)
    decode.abort("mismatch")
    decode.scheduler.expire_transfers(time.monotonic() + 3600)
    paged8 = PrefillEngine(EngineConfig(model_path=tiny_models("llama"), **(BASE | dict(page_size=8))), "p8")
    try:
        llama_decode = engines("llama", "decode", 2)
        with pytest.raises(ValueError, match="page_size 8 here vs 4 at the peer"):
            paged8.add_prefill_request([0, 5], SamplingParams(max_new_tokens=2), 78, llama_decode.kv.encoded, [1])
    finally:
        paged8.close()


# ---- real servers and the router ----------------------------------------------------------------

ONE_THREAD = ("--torch-threads", "1")  # see one_thread


@pytest.fixture(scope="module")
def clusters(tiny_models):
    """Two routers, each in front of one prefill and one decode server: P TP1 -> D TP2 and P TP2 -> D TP1."""
    model = tiny_models("llama")
    servers = {
        (role, tp): Server(role, model, "--tp-size", str(tp), "--max-running-requests", "8", *ONE_THREAD)
        for role in ("prefill", "decode")
        for tp in (1, 2)
    }
    routers = {}
    try:
        for s in servers.values():
            s.wait_ready()
        for p, d in ((1, 2), (2, 1)):
            routers[(p, d)] = RouterProcess(model, [servers[("prefill", p)]], [servers[("decode", d)]])
        for r in routers.values():
            r.wait_ready()
        yield model, servers, routers
    finally:
        for r in routers.values():
            r.stop()
        logs = {key: s.stop() for key, s in servers.items()}
        for key, s in servers.items():
            assert s.proc.returncode == 0, f"{key} did not exit cleanly on SIGTERM:\n{logs[key]}"


@pytest.mark.parametrize("prefill_tp, decode_tp", [(1, 2), (2, 1)])
def test_completions_through_the_router_across_tp_sizes_match_transformers(clusters, prefill_tp, decode_tp):
    model, servers, routers = clusters
    client = openai.OpenAI(base_url=f"{routers[(prefill_tp, decode_tp)].url}/v1", api_key="unused", timeout=120)
    prompts = make_prompts(3, seed=prefill_tp)
    expected = hf_greedy(model, prompts, 8)
    for ids, want in zip(prompts, expected):
        out = client.completions.create(
            model=model, prompt=ids, max_tokens=8, temperature=0, extra_body={"return_token_ids": True}
        )
        assert out.choices[0].model_extra["token_ids"] == want
    # Streamed, and one dropped by its client after a few chunks: both servers end idle.
    stream = client.completions.create(
        model=model, prompt=prompts[0], max_tokens=200, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    for i, _ in enumerate(stream):
        if i == 2:
            stream.close()
            break
    asyncio.run(wait_idle(servers[("prefill", prefill_tp)], servers[("decode", decode_tp)]))


def children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]


def test_a_dead_rank_takes_its_server_out_of_service_and_out_of_the_routers_pool(clusters):
    """A TP 2 decode server's rank 1 SIGKILLed: within a second or so its health is no longer SERVING (it says
    NOT_SERVING as it stops; a check in between finds the port closed) and it exits; a router in front of it
    and another decode server marks it unhealthy and serves every request from the other."""
    model, servers, _ = clusters
    kill_a_rank_and_check(model, Server("decode", model, "--tp-size", "2", *ONE_THREAD), servers[("decode", 1)])


def kill_a_rank_and_check(model: str, server: Server, other: Server, hf_device: str = "cpu") -> None:
    """SIGKILL rank 1 of `server` (a TP 2 decode server) behind a router that also has `other`; also run
    on two GPUs by tests/gpu/test_tp_disagg_cuda.py."""
    router = log = None
    try:
        server.wait_ready()
        other.wait_ready()
        router = RouterProcess(model, [], [server, other], "--disagg-policy", "never", "--health-check-interval", "0.2")
        router.wait_ready()
        [scheduler] = [c for c in children(server.proc.pid) if children(c)]  # the one with a rank under it
        [rank1] = children(scheduler)
        os.kill(rank1, signal.SIGKILL)
        killed, status = time.monotonic(), health_pb2.HealthCheckResponse.SERVING
        with grpc.insecure_channel(server.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while status == health_pb2.HealthCheckResponse.SERVING and server.proc.poll() is None:
                if time.monotonic() - killed > 5:
                    os.kill(scheduler, signal.SIGUSR1)  # its threads' stacks to the log (common/stacks.py)
                    time.sleep(1)
                    raise AssertionError("still serving 5 s after a TP rank died")
                try:
                    status = stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                except grpc.RpcError:
                    status = None  # (stopping: the port no longer answers)
                time.sleep(0.02)
        out_of_service = time.monotonic() - killed
        server.proc.wait(30)  # and then it exits, without hanging
        exited = time.monotonic() - killed
        while not any(server.address in url for url in router.unhealthy()):
            assert time.monotonic() - killed < 10, f"the router still routes to the dead server: {router.metrics()}"
            time.sleep(0.1)
        unrouted = time.monotonic() - killed
        print(f"\nrank killed -> not serving {out_of_service:.2f} s, exited {exited:.2f} s, unrouted {unrouted:.2f} s")
        assert not any(other.address in url for url in router.unhealthy())
        client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", timeout=60, max_retries=0)
        prompts = make_prompts(2, seed=9)
        for ids, want in zip(prompts, hf_greedy(model, prompts, 6, device=hf_device)):
            out = client.completions.create(
                model=model, prompt=ids, max_tokens=6, temperature=0, extra_body={"return_token_ids": True}
            )
            assert out.choices[0].model_extra["token_ids"] == want
    except AssertionError as failed:
        log = server.stop(signal.SIGKILL)
        raise AssertionError(f"{failed}\n---- the TP server's log ----\n{log}") from None
    finally:
        if router is not None:
            router.stop()
        if log is None:
            log = server.stop(signal.SIGKILL)
    assert "TP rank 1 exited" in log


# ---- without processes ---------------------------------------------------------------------------


def test_the_plan_gives_each_receiver_rank_its_heads_from_one_sender_rank():
    r = range
    assert plan_writes([r(0, 2)], [r(0, 1), r(1, 2)]) == [Write(0, 0, r(0, 1)), Write(0, 1, r(1, 2))]
    assert plan_writes([r(0, 1), r(1, 2)], [r(0, 2)]) == [Write(0, 0, r(0, 1)), Write(1, 0, r(1, 2))]
    assert plan_writes([r(0, 2), r(2, 4)], [r(0, 2), r(2, 4)]) == [Write(0, 0, r(0, 2)), Write(1, 1, r(2, 4))]
    assert plan_writes([r(0, 4)], [r(0, 4)]) == [Write(0, 0, r(0, 4))]
    # One KV head on two ranks each side: each decode rank gets it from "its" prefill rank.
    assert plan_writes([r(0, 1), r(0, 1)], [r(0, 1), r(0, 1)]) == [Write(0, 0, r(0, 1)), Write(1, 1, r(0, 1))]
    assert plan_writes([r(0, 1), r(0, 1)], [r(0, 1)]) == [Write(0, 0, r(0, 1))]
    # TP 4 over 2 heads (pairs share one) -> TP 1; and TP 1 -> TP 4
    assert plan_writes([r(0, 1), r(0, 1), r(1, 2), r(1, 2)], [r(0, 2)]) == [Write(0, 0, r(0, 1)), Write(2, 0, r(1, 2))]
    assert plan_writes([r(0, 2)], [r(0, 1), r(0, 1), r(1, 2), r(1, 2)]) == [
        Write(0, 0, r(0, 1)),
        Write(0, 1, r(0, 1)),
        Write(0, 2, r(1, 2)),
        Write(0, 3, r(1, 2)),
    ]
    with pytest.raises(ValueError, match="KV head 2 of receiver rank 0 is held by no sender rank"):
        plan_writes([r(0, 2)], [r(0, 4)])


def layouts(tp: int, heads: int = 2) -> list[KVLayout]:
    from pdserve.common.engine.models.parallel import kv_heads_of_rank

    return [
        KVLayout(4, 2, len(h), 8, "float32", 64, h.start, heads)
        for h in (kv_heads_of_rank(heads, tp, r) for r in range(tp))
    ]


def test_a_room_completes_only_when_every_rank_has_all_its_heads():
    arrivals = KVArrivals(layouts(2), vocab_size=100)
    waiting = {7}
    granted = {7: 3}.get
    one_head = layouts(2)[0].transfer_bytes(3)

    def accept(rank, notif):  # (accepted against the grant, then landed: no integrity check)
        landing = arrivals.accept(rank, notif, granted, waiting.__contains__)
        return None if landing is None else arrivals.land(landing)

    assert accept(1, encode_notif(7, 5, None, 3, one_head, range(1, 2))) is None
    assert accept(1, encode_notif(7, 5, None, 3, one_head, range(1, 2))) is None  # a duplicate: no change
    assert arrivals.partial == {7: [set(), {1}]}
    assert accept(0, encode_notif(7, 5, None, 3, one_head)) == (7, 5, None)  # None: all of rank 0's heads
    assert arrivals.partial == {}
    waiting.clear()
    assert accept(0, encode_notif(7, 5, None, 3, one_head, range(0, 1))) is None  # a late copy: ignored
    refusals = {
        "head_range": (0, encode_notif(7, 5, None, 3, one_head, range(1, 2))),  # rank 0 holds head 0 only
        "byte_count": (0, encode_notif(7, 5, None, 3, 2 * one_head, range(0, 1))),
        "page_count": (1, encode_notif(7, 5, None, 2, one_head, range(1, 2))),
        "unknown_room": (1, encode_notif(8, 5, None, 3, one_head, range(1, 2))),
        "malformed": (1, encode_notif(7, 100, None, 3, one_head, range(1, 2))),
    }
    for reason, (rank, notif) in refusals.items():
        with pytest.raises(Refused) as refused:
            accept(rank, notif)
        assert refused.value.reason == reason
    # From a TP 1 prefill to a TP 1 decode: one notification, every head.
    single = KVArrivals(layouts(1), vocab_size=100)
    landing = single.accept(
        0, encode_notif(9, 1, None, 1, layouts(1)[0].transfer_bytes(1)), {9: 1}.get, {9}.__contains__
    )
    assert single.land(landing) == (9, 1, None)
    # A room that stops waiting with heads missing is forgotten.
    waiting.add(7)
    accept(1, encode_notif(7, 5, None, 3, one_head, range(1, 2)))
    arrivals.forget(set().__contains__)
    assert arrivals.partial == {}


class FakeAgent:
    """Rank 0's agent: WRITEs recorded, states set by the test."""

    def __init__(self, name, layout):
        self.name, self.layout = name, layout
        self.peers, self.writes, self.states, self.released = [], [], {}, []

    def metadata(self):
        return PoolMetadata(
            self.name, self.layout, "DRAM", 0, (1,) * self.layout.num_layers, (2,) * self.layout.num_layers, b"t"
        )

    def add_peer(self, meta):
        self.peers.append(meta.name)
        return meta.name

    def remove_peer(self, name):
        self.peers.remove(name)

    def write_pages(self, peer, src, dst, notif, heads=None):
        if peer not in self.peers:
            raise KVTransferError(f"unknown peer {peer!r}")
        handle = TransferHandle(peer, len(src), 0)
        self.writes.append((peer, src, dst, decode_notif(notif) if notif else None, heads))
        self.states[id(handle)] = TransferState.IN_PROGRESS
        return handle

    def poll(self, handle):
        return self.states[id(handle)]

    def release(self, handle):
        self.released.append(handle)


class FakeWorkers:
    def __init__(self):
        self.sent, self.broadcasts, self.reports = [], [], []

    def send_to(self, rank, msg):
        self.sent.append((rank, msg))

    def broadcast(self, msg):
        self.broadcasts.append(msg)

    def take(self, kind):
        got = [r for r in self.reports if isinstance(r, kind)]
        self.reports = [r for r in self.reports if not isinstance(r, kind)]
        return got


def fake_server(name, tp):
    pools = [
        PoolMetadata(f"{name}.tp{r}" if r else name, layout, "DRAM", 0, (1, 1), (2, 2), b"t")
        for r, layout in enumerate(layouts(tp))
    ]
    return pools


def test_the_sender_splits_a_write_over_its_ranks_and_waits_for_all():
    agent = FakeAgent("p", layouts(2)[0])
    workers = FakeWorkers()
    sender = KVSender(ServerKV(agent, [agent.metadata(), fake_server("p", 2)[1]]), workers)
    decode = encode_pool_metadata(fake_server("d", 1))  # TP 2 -> TP 1
    assert sender.add_peer(decode) == "d" and sender.add_peer(decode) == "d"
    assert agent.peers == ["d"] and [(r, type(m)) for r, m in workers.sent] == [(1, AddPeers)]
    assert [p.name for p in decode_pool_metadata(workers.sent[0][1].metadata)] == ["d"]
    workers.sent.clear()

    group = sender.write("d", [3, 4], [9, 10], room=5, first_token=7, logprobs=None)
    [(peer, src, dst, notif, heads)] = agent.writes
    assert (peer, src, dst, heads) == ("d", [3, 4], [9, 10], range(0, 1))
    half = layouts(1)[0].transfer_bytes(2, 1)
    expected = {"room": 5, "first_token": 7, "logprobs": None, "pages": 2, "bytes": half, "heads": range(0, 1)}
    assert notif == expected | {"sum": None}
    [(rank, order)] = workers.sent
    assert rank == 1 and isinstance(order, WriteKV) and (order.peer, order.head_start, order.head_stop) == ("d", 1, 2)
    assert decode_notif(order.notif)["heads"] == range(1, 2) and group.num_bytes == 2 * half
    agent.states[id(group.local[0])] = TransferState.DONE
    assert sender.poll(group) is TransferState.IN_PROGRESS  # rank 1 has not reported
    workers.reports.append(WriteEnded(order.id, 1, "done"))
    assert sender.poll(group) is TransferState.DONE and sender.open_transfers() == 0
    sender.release(group)
    assert not any(isinstance(m, CancelWrite) for _, m in workers.sent)

    # A rank's failure fails the group; a group given up on cancels the WRITEs still running.
    failed = sender.write("d", [3], [9], room=6, first_token=7, logprobs=None)
    workers.reports.append(WriteEnded(workers.sent[-1][1].id, 1, "failed", "WRITE to d failed"))
    assert sender.poll(failed) is TransferState.FAILED and "TP rank 1" in sender.failure(failed)
    late = sender.write("d", [3], [9], room=8, first_token=7, logprobs=None)
    late_id = workers.sent[-1][1].id
    sender.release(late)
    assert workers.sent[-1] == (1, CancelWrite(late_id)) and sender.open_transfers() == 0
    sender.remove_peer("d")
    assert agent.peers == [] and workers.broadcasts == [ForgetPeers(["d"])]
    with pytest.raises(ValueError, match=r"rank 1 of 2 .* model_kv_heads 2 here vs 4"):
        bad = fake_server("e", 2)
        bad[1] = PoolMetadata("e.tp1", KVLayout(4, 2, 2, 8, "float32", 64, 2, 4), "DRAM", 0, (1, 1), (2, 2), b"t")
        sender.add_peer(encode_pool_metadata(bad))


class Done:
    def __init__(self, done):
        self.done = done

    def query(self):
        return self.done


def test_a_rank_writes_only_after_its_forward_and_cancels_before_the_next_step():
    agent = FakeAgent("p.tp1", layouts(2)[1])
    reports = []
    duty = SenderDuty(1, agent, reports.append)
    duty.handle(AddPeers(encode_pool_metadata(fake_server("d", 1))), None)
    forward = Done(False)
    order = WriteKV(1, "d", [3], [9], 1, 2, encode_notif(5, 7, None, 1, 64, range(1, 2)))
    duty.handle(order, forward)
    duty.poll()
    assert agent.writes == [] and duty.active  # its forward has not completed
    forward.done = True
    duty.poll()
    assert agent.writes[0][4] == range(1, 2)
    agent.states[id(duty.posted[1])] = TransferState.DONE
    duty.poll()
    assert reports == [WriteEnded(1, 1, "done")] and not duty.active
    duty.handle(WriteKV(2, "d", [4], [10], 1, 2, b""), None)
    duty.poll()
    duty.handle(CancelWrite(2), None)  # running: released (aborted) at once
    duty.handle(WriteKV(3, "d", [4], [10], 1, 2, b""), Done(False))
    duty.handle(CancelWrite(3), None)  # not started: dropped
    duty.handle(Probe(9), None)
    assert reports[1:] == [WriteEnded(2, 1, "cancelled"), WriteEnded(3, 1, "cancelled"), RankState(1, 9, 0)]
    assert len(agent.released) == 2 and len(agent.writes) == 2
    duty.handle(WriteKV(4, "unknown", [4], [10], 1, 2, b""), None)
    duty.poll()
    assert reports[-1].state == "failed" and "could not start" in reports[-1].error

    receiver = ReceiverDuty(1, type("A", (), {"get_notifs": lambda self: [("p", b"n")]})(), reports.append)
    receiver.handle(Watch(True), None)
    receiver.poll()
    assert receiver.active and reports[-1].notifs == [("p", b"n")] and reports[-1].rank == 1
