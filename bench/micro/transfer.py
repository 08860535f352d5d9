"""The KV transfer micro-benchmark (`pdserve bench transfer`): N requests x L tokens WRITten from one
pool into another, each pool in its own process with its own agent, as a prefill and a decode server
hold them.

    sender process (its GPU, or the CPU)  --write_pages-->  receiver process (its GPU, or the CPU)
                                          <--NIXL notif--   (the receiver's get_notifs loop stamps it)

For each path (direct: a device copy through CUDA IPC; nixl: NIXL WRITEs) it reports, per request:
the sending thread's host time to post the WRITE (`write_pages`) and its whole host time (posting,
polling and releasing it, shared out over the requests), the transport operations it posted
(descriptors or kernel launches), and the latency from the post to the receiver holding the
notification; and over the run the bytes moved per second. Two phases: `serial` (one request at a
time: the latency of one transfer) and `burst` (all N posted, then polled: what a full batch sees).
Every destination page is checked against its source after the run (the bytes, not just the count).

Clocks: both processes stamp time.monotonic(), one clock for the whole host (CLOCK_MONOTONIC).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import statistics
import time
from dataclasses import asdict, dataclass

from pdserve.bench.shapes import resolve_shape

RECEIVER = "bench-transfer-receiver"
SENDER = "bench-transfer-sender"
WAIT_S = 120.0  # the longest any phase may take before the benchmark gives up


@dataclass(frozen=True)
class KVShape:
    num_layers: int
    kv_heads: int
    head_dim: int


def kv_shape(name: str) -> KVShape:
    """The KV cache shape of a bench/shapes.py model shape."""
    arch, c = resolve_shape(name)
    if arch == "gpt2":
        return KVShape(c["n_layer"], c["n_head"], c["n_embd"] // c["n_head"])
    heads = c["num_attention_heads"]
    return KVShape(
        c["num_hidden_layers"], c.get("num_key_value_heads", heads), c.get("head_dim", c["hidden_size"] // heads)
    )


@dataclass(frozen=True)
class Plan:
    device: str  # "cpu" or "cuda"
    shape: KVShape
    dtype: str
    page_size: int
    requests: int
    tokens: int
    fragment: bool  # pages handed out shuffled (short runs) rather than in order
    sender_gpu: int
    receiver_gpu: int
    seed: int = 0
    time_calls: bool = False  # timers on the calls inside write_pages (bench/micro/call_timer.py)

    @property
    def pages_per_request(self) -> int:
        return -(-self.tokens // self.page_size)

    @property
    def phases(self) -> tuple[tuple[str, int], ...]:
        """(phase, requests): a few unmeasured, then one at a time, then all at once."""
        return (("warmup", min(8, self.requests)), ("serial", min(64, self.requests)), ("burst", self.requests))

    @property
    def pool_pages(self) -> int:
        return self.requests * self.pages_per_request + 1  # (page 0 is reserved)

    def pages(self, seed: int) -> list[list[int]]:
        """Each request's pages of a pool: in order, or shuffled."""
        pages = list(range(1, self.pool_pages))
        if self.fragment:
            random.Random(seed).shuffle(pages)
        n = self.pages_per_request
        return [pages[i * n : (i + 1) * n] for i in range(self.requests)]


def _pool(plan: Plan, fill_seed: int | None):
    import torch

    from pdserve.common.engine.kv_pool import PagedKVPool

    device = torch.device("cuda", 0) if plan.device == "cuda" else torch.device("cpu")
    s = plan.shape
    pool = PagedKVPool(
        plan.pool_pages, plan.page_size, s.num_layers, s.kv_heads, s.head_dim, getattr(torch, plan.dtype), device
    )
    if fill_seed is not None:
        for i, buffer in enumerate([*pool.k_storage, *pool.v_storage]):
            g = torch.Generator(device).manual_seed(fill_seed * 1000 + i)
            raw = buffer.view(torch.uint8)
            raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g, device=device))
    return pool


def _visible(plan: Plan, gpu: int) -> None:
    if plan.device == "cuda":
        os.environ["CUDA_VISIBLE_DEVICES"] = str(gpu)  # before CUDA starts in this process


def receiver(plan: Plan, conn) -> None:
    """Publish the pool, stamp every notification as it arrives, then check the pages it was given."""
    _visible(plan, plan.receiver_gpu)
    from pdserve.common.kv_transfer.nixl_agent import NixlKVAgent
    from pdserve.common.kv_transfer.notif import decode_notif
    from pdserve.common.kv_transfer.pool_metadata import encode_pool_metadata

    pool = _pool(plan, fill_seed=None)
    agent = NixlKVAgent(RECEIVER, pool)
    conn.send(encode_pool_metadata([agent.metadata()]))
    while True:
        expect = conn.recv()  # ("expect", n) or ("check", pairs) or ("stop",)
        if expect[0] == "stop":
            agent.close()
            return
        if expect[0] == "check":
            conn.send(_check(plan, pool, expect[1]))
            continue
        arrived: dict[int, float] = {}
        deadline = time.monotonic() + WAIT_S
        while len(arrived) < expect[1] and time.monotonic() < deadline:
            for _, notif in agent.get_notifs():
                arrived[decode_notif(notif)["room"]] = time.monotonic()
        conn.send(arrived)


def _check(plan: Plan, pool, pairs: list[tuple[list[int], list[int]]]) -> int:
    """Destination pages that differ from the source pages they were written from (0: all equal)."""
    import torch

    source = _pool(plan, fill_seed=plan.seed + 1)  # the sender's contents, made again from its seed
    bad = 0
    for src_buf, dst_buf in zip([*source.k_storage, *source.v_storage], [*pool.k_storage, *pool.v_storage]):
        # (as bytes: random bits make NaNs, which never equal themselves)
        s = src_buf.view(torch.uint8).view(plan.pool_pages, -1)
        d = dst_buf.view(torch.uint8).view(plan.pool_pages, -1)
        for src, dst in pairs:
            i, j = torch.tensor(src, device=s.device), torch.tensor(dst, device=d.device)
            bad += int((s.index_select(0, i) != d.index_select(0, j)).any(dim=1).sum())
    return bad


def sender(plan: Plan, path: str, metadata: bytes, conn) -> None:
    """Post every request's WRITE, serial then burst, timing the sending thread."""
    _visible(plan, plan.sender_gpu)
    from pdserve.common.kv_transfer.base import TransferState
    from pdserve.common.kv_transfer.nixl_agent import NixlKVAgent
    from pdserve.common.kv_transfer.notif import encode_notif, new_room
    from pdserve.common.kv_transfer.pool_metadata import decode_pool_metadata

    timer = None
    if plan.time_calls:
        from pdserve.bench.micro.call_timer import time_write_calls

        timer = time_write_calls()
    pool = _pool(plan, fill_seed=plan.seed + 1)
    agent = NixlKVAgent(SENDER, pool, path=path)
    peer = agent.add_peer(decode_pool_metadata(metadata)[0])
    src_pages, dst_pages = plan.pages(plan.seed + 2), plan.pages(plan.seed + 3)
    nbytes = agent.layout.transfer_bytes(plan.pages_per_request)

    def post(i: int):
        notif = encode_notif(r := new_room(), 0, None, plan.pages_per_request, nbytes, agent.layout.heads)
        stamp, t0 = time.monotonic(), time.perf_counter()
        handle = agent.write_pages(peer, src_pages[i], dst_pages[i], notif)
        return r, handle, time.perf_counter() - t0, stamp

    def finish(handles: list) -> float:
        """Poll every handle until done and release it; the host time it took."""
        spent, open_ = 0.0, list(handles)
        deadline = time.monotonic() + WAIT_S
        while open_:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(open_)} WRITEs still running after {WAIT_S}s")
            t0 = time.perf_counter()
            still = []
            for h in open_:
                state = agent.poll(h)
                if state is TransferState.IN_PROGRESS:
                    still.append(h)
                    continue
                agent.release(h)
                if state is not TransferState.DONE:
                    raise RuntimeError(f"{h} failed")
            spent += time.perf_counter() - t0
            open_ = still
        return spent

    conn.send(("route", agent.route(peer), nbytes))
    for phase, count in plan.phases:
        conn.recv()  # the receiver is listening
        posts, host = [], 0.0
        started = time.monotonic()
        if phase == "burst":
            posts = [post(i) for i in range(count)]
            host = sum(p[2] for p in posts) + finish([p[1] for p in posts])
        else:
            for i in range(count):
                p = post(i)
                posts.append(p)
                host += p[2] + finish([p[1]])
        ops = [p[1].ops for p in posts]
        conn.send(("posted", phase, started, [(p[0], p[2], p[3]) for p in posts], host, ops))
    conn.send(("pages", list(zip(src_pages, dst_pages)), timer.summary() if timer else {}))
    conn.recv()
    agent.close()


@dataclass
class PhaseResult:
    path: str
    route: str
    phase: str
    requests: int
    post_us_p50: float  # write_pages on the sending thread
    post_us_p99: float
    host_us_per_request: float  # posting + polling + releasing, over the requests
    ops_per_request: float  # NIXL descriptors, or kernel launches of a device copy
    notif_ms_p50: float  # from the post to the receiver holding the notification
    notif_ms_p99: float
    gb_per_s: float  # bytes moved / (last notification - first post)
    mib_per_request: float


def run_path(plan: Plan, path: str) -> tuple[list[PhaseResult], int, dict]:
    ctx = mp.get_context("spawn")
    r_conn, r_theirs = ctx.Pipe()
    s_conn, s_theirs = ctx.Pipe()
    recv = ctx.Process(target=receiver, args=(plan, r_theirs), daemon=True)
    recv.start()
    if not r_conn.poll(WAIT_S):
        raise TimeoutError("the receiver did not publish its pool")
    metadata = r_conn.recv()
    send = ctx.Process(target=sender, args=(plan, path, metadata, s_theirs), daemon=True)
    send.start()
    results: list[PhaseResult] = []
    try:
        _, route, nbytes = _recv(s_conn, send)
        for phase, count in plan.phases:
            r_conn.send(("expect", count))
            s_conn.send("go")
            _, _, started, posts, host, ops = _recv(s_conn, send)
            arrived = _recv(r_conn, recv)
            if len(arrived) != count:
                raise RuntimeError(f"{phase}: {len(arrived)} of {count} notifications arrived in {WAIT_S}s")
            if phase == "warmup":
                continue
            lat = sorted(arrived[room] - stamp for room, _, stamp in posts)
            post_us = sorted(t * 1e6 for _, t, _ in posts)
            span = max(arrived.values()) - started
            results.append(
                PhaseResult(
                    path=path,
                    route=route,
                    phase=phase,
                    requests=count,
                    post_us_p50=statistics.median(post_us),
                    post_us_p99=post_us[min(len(post_us) - 1, int(0.99 * len(post_us)))],
                    host_us_per_request=host / count * 1e6,
                    ops_per_request=statistics.mean(ops),
                    notif_ms_p50=statistics.median(lat) * 1e3,
                    notif_ms_p99=lat[min(len(lat) - 1, int(0.99 * len(lat)))] * 1e3,
                    gb_per_s=count * nbytes / span / 1e9,
                    mib_per_request=nbytes / 2**20,
                )
            )
        _, pairs, calls = _recv(s_conn, send)
        r_conn.send(("check", pairs))
        bad = _recv(r_conn, recv)
        s_conn.send("stop")
        r_conn.send(("stop",))
    finally:
        for p in (send, recv):
            p.join(30)
            if p.is_alive():
                p.kill()
    return results, bad, calls


def _recv(conn, proc):
    deadline = time.monotonic() + WAIT_S
    while not conn.poll(0.2):
        if not proc.is_alive():
            raise RuntimeError(f"the {proc.name} process exited with code {proc.exitcode}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no answer from the {proc.name} process in {WAIT_S}s")
    return conn.recv()


def run_transfer(args) -> int:
    plan = Plan(
        device=args.device,
        shape=kv_shape(args.shape),
        dtype=args.dtype or ("bfloat16" if args.device == "cuda" else "float32"),
        page_size=args.page_size,
        requests=args.requests,
        tokens=args.tokens,
        fragment=args.fragment,
        sender_gpu=args.sender_gpu,
        receiver_gpu=args.receiver_gpu,
        time_calls=args.time_calls,
    )
    paths = args.paths or (["direct", "nixl"] if plan.device == "cuda" else ["nixl"])
    if plan.device != "cuda" and set(paths) - {"auto", "nixl"}:
        raise ValueError("--paths direct needs --device cuda: a device copy moves VRAM")
    if plan.requests < 1 or plan.tokens < 1:
        raise ValueError("--requests and --tokens must be >= 1")
    where = f"GPU {plan.sender_gpu} -> GPU {plan.receiver_gpu}" if plan.device == "cuda" else "CPU (DRAM -> DRAM)"
    print(
        f"KV transfer: {args.shape} ({plan.shape.num_layers} layers, {plan.shape.kv_heads} KV heads x "
        f"{plan.shape.head_dim}, {plan.dtype}), {plan.requests} requests x {plan.tokens} tokens, page "
        f"{plan.page_size}, {where}{', pages shuffled' if plan.fragment else ''}"
    )
    header = (
        f"{'path':<7}{'phase':<8}{'post us p50':>12}{'p99':>8}{'host us/req':>12}{'ops/req':>9}"
        f"{'notif ms p50':>13}{'p99':>8}{'GB/s':>8}  route"
    )
    print(header)
    rows, failed, calls = [], 0, {}
    for path in paths:
        results, bad, calls[path] = run_path(plan, path)
        failed += bad
        for r in results:
            rows.append(asdict(r))
            print(
                f"{r.path:<7}{r.phase:<8}{r.post_us_p50:>12.1f}{r.post_us_p99:>8.1f}{r.host_us_per_request:>12.1f}"
                f"{r.ops_per_request:>9.0f}{r.notif_ms_p50:>13.3f}{r.notif_ms_p99:>8.3f}{r.gb_per_s:>8.2f}  {r.route}"
            )
        if bad:
            print(f"{path}: {bad} destination pages differ from their source")
        for label, c in calls[path].items():
            print(f"  {path} call {label:<44}{c['p50_us']:>9.1f} us p50{c['mean_us']:>9.1f} mean{c['calls']:>7} calls")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"plan": asdict(plan), "results": rows, "bad_pages": failed, "calls": calls}, f, indent=1)
    return 1 if failed else 0
