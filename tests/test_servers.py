"""prefill-server and decode-server as real processes: real gRPC, real ZMQ IPC, real NIXL (DRAM).

The client here follows the router's protocol (docs/architecture.md, "The disaggregated request"): Generate on the
decode server, whose first message is the KV destination; Prefill on the prefill server with that
destination; then the decode stream to its end.
"""

import asyncio
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.common.ports import free_port
from pdserve.proto import pdserve_pb2 as pb
from pdserve.proto import pdserve_pb2_grpc as pb_grpc
from tests.test_disagg_engines import hf_greedy

# Long enough for a loaded 2-core CI box (6 s once timed out a request of test_router_reliability's
# 200-stream burst: three servers, each with a NIXL thread polling, plus router and client, on two
# cores); the timeout tests wait this long.
KV_TIMEOUT = 10.0

# NOTE: gRPC waits before reconnecting to an address that refused it, doubling the wait (1 s, 1.6 s,
# ...): a channel that polled a server through its ~6 s start saw it serving ~3 s late. Retry often.
READY_POLL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 200),
)


class Server:
    def __init__(self, role: str, model: str, *flags: str, warm_grammars: bool = False):
        """`warm_grammars`: structured output's machinery made during start-up, as a server does by
        default; off here (--disable-grammar-warmup) for the tests that send no grammar: each server
        would start a grammar worker process, ~2 s of CPU on the 2-core CI box."""
        self.role, self.port, self.metrics_port = role, free_port(), free_port()
        cmd = [
            sys.executable,
            "-m",
            f"pdserve.{role}.cli",
            "--model-path",
            model,
            "--device",
            "cpu",
            "--port",
            str(self.port),
            "--metrics-port",
            str(self.metrics_port),
            "--max-total-tokens",
            "4096",
            "--kv-transfer-timeout",
            str(KV_TIMEOUT),
            "--log-level",
            "warning",
            *(() if warm_grammars else ("--disable-grammar-warmup",)),
            *flags,
        ]
        # its own temporary directory, to see what it leaves there
        self.tmp = tempfile.mkdtemp(prefix="pdserve-test-server-")
        env = os.environ | {"TMPDIR": self.tmp}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.address = f"127.0.0.1:{self.port}"

    def wait_ready(self, timeout=120.0) -> None:
        deadline = time.monotonic() + timeout
        with grpc.insecure_channel(self.address, READY_POLL_OPTIONS) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                assert self.proc.poll() is None, f"{self.role} server exited:\n{self.proc.stdout.read()}"
                try:
                    if (
                        stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                        == health_pb2.HealthCheckResponse.SERVING
                    ):
                        return
                except grpc.RpcError:
                    time.sleep(0.2)
        raise TimeoutError(f"{self.role} server not ready in {timeout}s")

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            return r.read().decode()

    def stop(self, sig=signal.SIGTERM) -> str:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            out, _ = self.proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate(timeout=10)
        return out


@pytest.fixture(scope="module", params=["overlap", "serial"])
def servers(request, tiny_models):
    model = tiny_models("llama")
    flags = () if request.param == "overlap" else ("--disable-overlap-schedule",)
    decode = Server("decode", model, "--max-running-requests", "8", *flags)
    prefill = Server("prefill", model, "--chunked-prefill-size", "32", *flags)
    try:
        decode.wait_ready()
        prefill.wait_ready()
        yield model, decode, prefill
    finally:
        for s in (decode, prefill):
            log = s.stop()
            assert s.proc.returncode == 0, f"{s.role} did not exit cleanly on SIGTERM:\n{log}"
            left = os.listdir(s.tmp)
            shutil.rmtree(s.tmp, ignore_errors=True)
            assert not [f for f in left if f.startswith("pdserve-ipc-")], f"{s.role} left its ipc directory: {left}"


def params(max_new=12, **kw) -> pb.SamplingParams:
    """Every field set: in the proto, zero means zero, not 'default'."""
    base = dict(
        max_new_tokens=max_new, temperature=0.0, top_p=1.0, top_k=-1, repetition_penalty=1.0, skip_special_tokens=True
    )
    return pb.SamplingParams(**(base | kw))


async def generate(decode, prefill, prompt, sampling, rid, after_destination=None, cancel_after_tokens=None):
    """The router's protocol for one request; returns (tokens, finish or error, prefill response)."""
    async with grpc.aio.insecure_channel(decode.address) as dch, grpc.aio.insecure_channel(prefill.address) as pch:
        req = pb.GenerateRequest(
            request_id=rid, prompt_token_ids=prompt, params=sampling, bootstrap_room=random.getrandbits(63)
        )
        call = pb_grpc.DecodeServiceStub(dch).Generate(req, timeout=120)
        first = await call.read()
        if first.WhichOneof("response") != "destination":
            return [], first, None
        # The decode server frees the pages past this: the prefill server must not write later.
        assert time.time() < first.destination.expires_unix_s <= time.time() + KV_TIMEOUT
        if after_destination is not None:
            return await after_destination(call, first, pch, req)
        pre = await pb_grpc.PrefillServiceStub(pch).Prefill(
            pb.PrefillRequest(request=req, destination=first.destination), timeout=120
        )
        tokens, end = [], None
        while True:
            msg = await call.read()
            if msg is grpc.aio.EOF:
                break
            kind = msg.WhichOneof("response")
            if kind == "tokens":
                assert msg.tokens.index == len(tokens), "a chunk lost or repeated tokens"
                tokens += list(msg.tokens.token_ids)
                if cancel_after_tokens is not None and len(tokens) >= cancel_after_tokens:
                    call.cancel()
                    return tokens, None, pre
            else:
                end = msg
        return tokens, end, pre


def prompts(n, seed=0, low=1, high=70):
    rng = random.Random(seed)
    return [[0] + [rng.randrange(5, 512) for _ in range(rng.randrange(low, high))] for _ in range(n)]


async def load(server) -> pb.Load:
    async with grpc.aio.insecure_channel(server.address) as ch:
        stub = pb_grpc.DecodeServiceStub(ch) if server.role == "decode" else pb_grpc.PrefillServiceStub(ch)
        return await stub.GetLoad(pb.GetLoadRequest(), timeout=5)


async def wait_idle(*servers, timeout=KV_TIMEOUT + 10):
    deadline = time.monotonic() + timeout
    while True:
        loads = [await load(s) for s in servers]
        if all(x.kv_used_tokens == 0 and x.running_requests == 0 and x.waiting_requests == 0 for x in loads):
            return
        assert time.monotonic() < deadline, f"KV not back to idle: {loads}"
        await asyncio.sleep(0.1)


def test_greedy_through_prefill_and_decode_servers_matches_transformers(servers):
    model, decode, prefill = servers
    cases = prompts(8)
    expected = hf_greedy(model, cases, 12)

    async def main():
        return await asyncio.gather(
            *(generate(decode, prefill, p, params(12), f"par-{i}") for i, p in enumerate(cases))
        )

    results = asyncio.run(main())
    for (tokens, end, pre), want in zip(results, expected):
        assert tokens == want
        assert end.WhichOneof("response") == "finish" and end.finish.usage.completion_tokens == len(want)
        assert pre.first_token_id == want[0] and pre.timings.transfer_bytes > 0 and not pre.HasField("error")
    asyncio.run(wait_idle(decode, prefill))
    metrics = decode.metrics()
    assert 'pdserve_kv_used_tokens{role="decode"} 0.0' in metrics and "pdserve_kv_total_tokens" in metrics
    prefill_metrics = prefill.metrics()
    assert 'pdserve_kv_transfer_seconds_count{role="prefill"}' in prefill_metrics
    assert 'pdserve_kv_transfer_bytes_total{role="prefill"}' in prefill_metrics


def test_a_conversations_next_turn_sends_only_its_new_pages(servers):
    """Through the servers: the second turn (the first's prompt and answer, then a new message)
    is greedy as transformers, and its WRITE is the pages after what the decode server cached
    from the first turn (whose pages crossed whole); the decode server counts the tokens it held."""
    model, decode, prefill = servers
    first = [0] + [random.Random(5).randrange(5, 400) for _ in range(40)]
    [want1] = hf_greedy(model, [first], 6)
    second = first + want1 + [7, 8, 9, 10, 11]
    [want2] = hf_greedy(model, [second], 6)
    sent = []
    for rid, prompt, want in (("turn-1", first, want1), ("turn-2", second, want2)):
        tokens, end, pre = asyncio.run(generate(decode, prefill, prompt, params(6), rid))
        assert tokens == want and not pre.HasField("error")
        sent.append(pre.timings.transfer_bytes)
        asyncio.run(wait_idle(decode, prefill))
    page_size = 16  # the servers' default
    page_bytes = sent[0] // -(-len(first) // page_size)
    held = (len(first) + 6 - 1) // page_size  # whole pages of the first turn's KV (its last token's is never computed)
    assert sent[1] == page_bytes * (-(-len(second) // page_size) - held) < sent[0]
    hits = [
        line for line in decode.metrics().splitlines() if line.startswith("pdserve_kv_transfer_prefix_hit_tokens_total")
    ]
    assert hits and float(hits[0].split()[-1]) >= held * page_size
    lines = [line.split() for line in prefill.metrics().splitlines() if line.startswith("pdserve_prefill_")]
    counted = {name.split("{")[0]: float(value) for name, value in lines}
    # the prefill server's own cache held the first turn's whole pages when the second came
    assert counted["pdserve_prefill_cache_hit_tokens_total"] >= len(first) // page_size * page_size
    assert counted["pdserve_prefill_prompt_tokens_total"] >= len(first) + len(second)


# Random tiny weights leave some steps with their top two logits within fp32 rounding (prompt 17
# below: 11.083960 vs 11.083954); there the argmax may go either way with the batch's shape (the
# GEMM's blocking differs), so a run's batching decides it.
TIE_LOGPROB = 1e-4


def assert_same_greedy(got: list[list[int]], reference) -> None:
    """`got` equals the reference's greedy tokens, except that a sequence may part from it at a step
    where the reference's top two logprobs are within TIE_LOGPROB (and then differ after it); at
    most two sequences may."""
    parted = []
    for i, (tokens, ref) in enumerate(zip(got, reference)):
        if tokens == ref.output_ids:
            continue
        step = next(k for k, (a, b) in enumerate(zip(tokens, ref.output_ids)) if a != b)
        (first_id, first), (second_id, second) = ref.logprobs[step].top[:2]
        assert first - second < TIE_LOGPROB and tokens[step] in (first_id, second_id), (
            f"sequence {i} parts from the reference at step {step}: {tokens} != {ref.output_ids}"
        )
        parted.append(i)
    assert len(got) == len(reference) and len(parted) <= 2, parted


def test_64_concurrent_requests_complete_with_nothing_lost(servers):
    model, decode, prefill = servers
    cases = prompts(64, seed=3, high=40)

    async def main():
        return await asyncio.gather(
            *(generate(decode, prefill, p, params(10, ignore_eos=True), f"many-{i}") for i, p in enumerate(cases))
        )

    results = asyncio.run(main())
    from pdserve.common.engine.engine import Engine
    from pdserve.common.types import SamplingParams

    local = Engine(model_path=model, device="cpu", max_total_tokens=8192).generate(
        cases, SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True, logprobs=2)
    )
    assert_same_greedy([tokens for tokens, _, _ in results], local)
    assert all(end.finish.reason == pb.FINISH_REASON_LENGTH for _, end, _ in results)
    asyncio.run(wait_idle(decode, prefill))


def test_aborts_at_every_stage_free_kv_on_both_sides(servers):
    model, decode, prefill = servers

    async def cancel_while_waiting_for_kv(call, first, pch, req):
        call.cancel()  # the destination is held; no prefill will ever come
        return [], None, None

    async def cancel_prefill_midway(call, first, pch, req):
        stub = pb_grpc.PrefillServiceStub(pch)
        with pytest.raises(grpc.aio.AioRpcError):
            await stub.Prefill(pb.PrefillRequest(request=req, destination=first.destination), timeout=0.01)
        call.cancel()
        return [], None, None

    async def abort_rpc_then_prefill(call, first, pch, req):
        async with grpc.aio.insecure_channel(decode.address) as ch:
            found = await pb_grpc.DecodeServiceStub(ch).Abort(pb.AbortRequest(request_id=req.request_id), timeout=5)
        assert found.found
        msg = await call.read()
        assert msg.finish.reason == pb.FINISH_REASON_ABORT
        # the prefill still WRITEs into pages the decode keeps quarantined until the WRITE is done
        pre = await pb_grpc.PrefillServiceStub(pch).Prefill(
            pb.PrefillRequest(request=req, destination=first.destination), timeout=60
        )
        return [], msg, pre

    async def streamed_without_a_destination(call, first, pch, req):
        streamed = pb_grpc.PrefillServiceStub(pch).PrefillStreamed(timeout=60)
        await streamed.write(pb.PrefillRequest(request=req))
        await streamed.done_writing()
        answer = await streamed
        assert answer.HasField("error") and "without a KV destination" in answer.error.message
        call.cancel()
        return [], None, answer

    async def main():
        long_prompt = prompts(1, seed=9, low=200, high=201)[0]
        await asyncio.gather(
            generate(
                decode,
                prefill,
                prompts(1, seed=4)[0],
                params(40),
                "ab-st2",
                after_destination=streamed_without_a_destination,
            ),
            generate(
                decode,
                prefill,
                prompts(1, seed=5)[0],
                params(40),
                "ab-kv",
                after_destination=cancel_while_waiting_for_kv,
            ),
            generate(decode, prefill, long_prompt, params(40), "ab-pre", after_destination=cancel_prefill_midway),
            generate(
                decode, prefill, prompts(1, seed=6)[0], params(40), "ab-rpc", after_destination=abort_rpc_then_prefill
            ),
            generate(
                decode, prefill, prompts(1, seed=7)[0], params(60, ignore_eos=True), "ab-dec", cancel_after_tokens=3
            ),
        )
        # waiting on decode for a row: more requests than --max-running-requests, the last cancelled
        calls = [
            generate(decode, prefill, p, params(30, ignore_eos=True), f"ab-q{i}")
            for i, p in enumerate(prompts(9, seed=8))
        ]
        tasks = [asyncio.create_task(c) for c in calls]
        await asyncio.sleep(0.05)
        tasks[-1].cancel()
        done = await asyncio.gather(*tasks, return_exceptions=True)
        assert sum(isinstance(d, tuple) for d in done) >= 8
        await wait_idle(decode, prefill)

    asyncio.run(main())


def test_a_prefill_cancelled_before_its_destination_frees_its_kv_at_once(servers):
    """PrefillStreamed: the prompt is prefilled and parked, holding pages, until the destination
    comes; a client that cancels first frees them now, not after the KV transfer timeout."""
    model, decode, prefill = servers

    async def main():
        async with grpc.aio.insecure_channel(prefill.address) as pch:
            req = pb.GenerateRequest(
                request_id="st-cancel",
                prompt_token_ids=prompts(1, seed=3)[0],
                params=params(8),
                bootstrap_room=random.getrandbits(63),
            )
            streamed = pb_grpc.PrefillServiceStub(pch).PrefillStreamed(timeout=60)
            await streamed.write(pb.PrefillRequest(request=req))
            deadline = time.monotonic() + 30
            while (await load(prefill)).running_requests == 0:  # prefilled and parked
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)
            assert (await load(prefill)).kv_used_tokens > 0
            streamed.cancel()
            await wait_idle(prefill, timeout=KV_TIMEOUT / 2)

    asyncio.run(main())


def test_kv_that_never_arrives_times_out_with_a_clear_error(servers):
    model, decode, prefill = servers

    async def never_prefill(call, first, pch, req):
        msg = await call.read()  # no prefill: the decode must give up by itself
        return [], msg, None

    _, end, _ = asyncio.run(generate(decode, prefill, [0, 9, 8, 7], params(5), "lost", after_destination=never_prefill))
    assert end.WhichOneof("response") == "error" and end.error.code == pb.Error.KV_TRANSFER_TIMEOUT
    assert "timed out" in end.error.message
    asyncio.run(wait_idle(decode, prefill))


def test_bad_requests_get_clear_errors(servers):
    _, decode, prefill = servers
    _, end, _ = asyncio.run(generate(decode, prefill, [0, 10**6], params(5), "bad-ids"))
    assert end.error.code == pb.Error.INVALID_REQUEST and "out of range" in end.error.message
    _, end, _ = asyncio.run(generate(decode, prefill, [0, 5], params(5, top_p=0.0), "bad-top-p"))
    assert end.error.code == pb.Error.INVALID_REQUEST and "top_p" in end.error.message
    asyncio.run(wait_idle(decode, prefill))


def test_a_prefill_killed_mid_request_leaves_decode_healthy(servers, tiny_models):
    model, decode, prefill = servers
    doomed = Server("prefill", model, "--max-running-requests", "4")
    doomed.wait_ready()

    async def kill_during_prefill(call, first, pch, req):
        async with grpc.aio.insecure_channel(doomed.address) as ch:
            # The request first, the destination held back: the doomed server prefills it and
            # keeps it (KV computed, call open). A timed kill raced a prefill that can finish in
            # well under 50 ms on CPU.
            pending = pb_grpc.PrefillServiceStub(ch).PrefillStreamed(timeout=30)
            await pending.write(pb.PrefillRequest(request=req))
            deadline = time.monotonic() + 30
            while (await load(doomed)).running_requests == 0:
                assert time.monotonic() < deadline, "the doomed server never took the request"
                await asyncio.sleep(0.01)
            await pending.write(pb.PrefillRequest(destination=first.destination))
            os.kill(doomed.proc.pid, signal.SIGKILL)  # before, during or after its WRITE
            with pytest.raises(grpc.aio.AioRpcError):
                await pending
        last = None
        while (msg := await call.read()) is not grpc.aio.EOF:  # tokens, if the WRITE beat the kill
            last = msg
        return [], last, None

    try:
        _, end, _ = asyncio.run(
            generate(
                decode,
                prefill,
                prompts(1, seed=11, low=150, high=151)[0],
                params(5),
                "killed",
                after_destination=kill_during_prefill,
            )
        )
    finally:
        doomed.stop(signal.SIGKILL)
    # either the WRITE landed before the kill (then decoding finished) or the decode timed out
    assert end.WhichOneof("response") in ("finish", "error")
    asyncio.run(wait_idle(decode))
    tokens, end, _ = asyncio.run(generate(decode, prefill, [0, 5, 6], params(4, ignore_eos=True), "after-kill"))
    assert len(tokens) == 4 and end.WhichOneof("response") == "finish"


def test_sigterm_drains_in_flight_requests_then_exits(tiny_models):
    model = tiny_models("llama")
    decode, prefill = Server("decode", model), Server("prefill", model)
    try:
        decode.wait_ready()
        prefill.wait_ready()

        async def main():
            # Long enough to still be decoding when the late request comes (40 tokens once were
            # all done within the 0.3 s below, and the drained server was gone).
            started = [
                asyncio.create_task(generate(decode, prefill, p, params(400, ignore_eos=True), f"drain-{i}"))
                for i, p in enumerate(prompts(4, seed=12))
            ]
            for _ in range(200):  # until decoding is under way
                if (await load(decode)).running_requests:
                    break
                await asyncio.sleep(0.02)
            decode.proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.3)
            _, refused, _ = await generate(decode, prefill, [0, 5, 6], params(4), "too-late")
            return await asyncio.gather(*started), refused

        results, refused = asyncio.run(main())
        assert all(len(tokens) == 400 and end.finish.reason == pb.FINISH_REASON_LENGTH for tokens, end, _ in results)
        assert refused.WhichOneof("response") == "error" and refused.error.code == pb.Error.OVERLOADED
        assert decode.proc.wait(60) == 0
    finally:
        decode.stop()
        prefill.stop()
