"""Disaggregation between different TP sizes on two GPUs: P TP1 (GPU 0) -> D TP2 (GPUs 0, 1) and
P TP2 (GPUs 0, 1) -> D TP1 (GPU 1), KV moved VRAM -> VRAM by NIXL from every prefill rank to the
decode ranks holding its heads. fp32 greedy parity with transformers; both servers' KV idle on
every rank at the end. Skipped with fewer than two GPUs.

Each engine runs in its own spawned process (its TP ranks are that process's children); the test
relays requests, KV destinations and results between them over pipes, as the router does over gRPC.
"""

import multiprocessing as mp
import random
import time

import pytest
import torch

from pdserve.common.tiny_model import make_tiny_model
from pdserve.common.types import SamplingParams
from tests.test_disagg_engines import hf_greedy

TIMEOUT_S = 300

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")


def worker(role: str, model: str, tp: int, device: str, conn) -> None:
    from pdserve.common.config import EngineConfig

    config = EngineConfig(
        model_path=model,
        device=device,
        dtype="float32",
        tp_size=tp,
        max_total_tokens=16384,
        page_size=16,
        chunked_prefill_size=64,
    )
    name = f"{role}-tp{tp}-{device.replace(':', '')}"
    if role == "decode":
        from pdserve.decode.engine import DecodeEngine

        engine = DecodeEngine(config, name)
    else:
        from pdserve.prefill.engine import PrefillEngine

        engine = PrefillEngine(config, name)
    try:
        loop = engine.event_loop()
        conn.send(("ready", [p.layout.heads for p in engine.kv.pools]))
        while True:
            if conn.poll(0 if engine.busy() else 0.005):
                msg = conn.recv()
                if msg[0] == "stop":
                    conn.send(("idle", engine.is_idle(), engine.ranks_open_transfers()))
                    return
                if role == "decode":
                    _, rid, prompt, params, room = msg
                    engine.add_decode_request(prompt, params, room, rid=rid)
                else:
                    _, rid, prompt, params, room, metadata, pages = msg
                    engine.add_prefill_request(prompt, params, room, metadata, pages, rid=rid)
            out = next(loop)
            if role == "decode":
                while engine.destinations:
                    d = engine.destinations.popleft()
                    conn.send(("dest", d.rid, d.room, d.agent_metadata, d.page_ids))
                for c in out:
                    conn.send(("done", c.rid, c.output_ids, c.error))
            else:
                for r in out:
                    conn.send(("pre", r.rid, r.first_token, r.transfer_bytes, r.error))
    finally:
        engine.close()


def run(model, prefill, decode, prompts, params):
    """prefill, decode: (tp, device). Returns the decode outputs and the heads each side's ranks hold."""
    ctx = mp.get_context("spawn")
    links = {}
    for role, (tp, device) in (("decode", decode), ("prefill", prefill)):
        mine, theirs = ctx.Pipe()
        proc = ctx.Process(target=worker, args=(role, model, tp, device, theirs), daemon=True)
        proc.start()
        links[role] = (mine, proc)
    dconn, pconn = links["decode"][0], links["prefill"][0]
    heads = {}
    for role, conn in (("decode", dconn), ("prefill", pconn)):
        assert conn.poll(TIMEOUT_S), f"{role} engine did not start"
        msg = conn.recv()
        assert msg[0] == "ready", msg
        heads[role] = msg[1]
    by_rid = {f"r{i}": p for i, p in enumerate(prompts)}
    rng = random.Random(0)
    for rid, p in by_rid.items():
        dconn.send(("add", rid, p, params, rng.getrandbits(63)))
    outputs, answered = {}, set()
    deadline = time.monotonic() + TIMEOUT_S
    while len(outputs) < len(prompts) or len(answered) < len(prompts):
        assert time.monotonic() < deadline, "disaggregated TP run timed out"
        for conn in (dconn, pconn):
            while conn.poll(0.001):
                msg = conn.recv()
                if msg[0] == "dest":
                    _, rid, room, metadata, pages = msg
                    pconn.send(("add", rid, by_rid[rid], params, room, metadata, pages))
                elif msg[0] == "done":
                    assert msg[3] is None, msg[3]
                    outputs[msg[1]] = msg[2]
                elif msg[0] == "pre":
                    assert msg[4] is None, msg[4]
                    answered.add(msg[1])
    for role, conn in (("decode", dconn), ("prefill", pconn)):
        conn.send(("stop",))
        assert conn.poll(60), f"{role} did not answer stop"
        _, idle, ranks = conn.recv()
        assert idle and not any(ranks), f"{role}: KV not back to idle on every rank ({ranks})"
    for _, proc in links.values():
        proc.join(60)
    return [outputs[f"r{i}"] for i in range(len(prompts))], heads


@pytest.mark.parametrize("kv_heads", [2, 1])
@pytest.mark.parametrize(
    "prefill, decode",
    [((1, "cuda:0"), (2, "cuda:0")), ((2, "cuda:0"), (1, "cuda:1"))],
    ids=["p_tp1-d_tp2", "p_tp2-d_tp1"],
)
def test_disaggregated_across_tp_sizes_on_two_gpus_matches_transformers(tmp_path, prefill, decode, kv_heads):
    model = str(make_tiny_model(tmp_path / "llama", "llama", 0, {"num_key_value_heads": kv_heads}))
    rng = random.Random(5)
    prompts = [[0] + [rng.randrange(5, 512) for _ in range(rng.randrange(1, 120))] for _ in range(16)]
    expected = hf_greedy(model, prompts, 12, device="cuda")
    got, heads = run(model, prefill, decode, prompts, SamplingParams(max_new_tokens=12, temperature=0))
    assert got == expected
    two = heads["decode"] if decode[0] == 2 else heads["prefill"]
    assert two == ([range(0, 1), range(1, 2)] if kv_heads == 2 else [range(0, 1), range(0, 1)])


def test_a_dead_rank_on_cuda_takes_its_server_out_of_service_and_out_of_the_routers_pool(tiny_models):
    """tests/test_tp_disagg.py's rank kill with real CUDA ranks: a TP 2 decode server on GPUs 0 and 1 loses
    rank 1 to SIGKILL; it stops serving and exits, and the router serves transformers' tokens from a TP 1
    decode server on GPU 0."""
    from tests.test_servers import Server
    from tests.test_tp_disagg import kill_a_rank_and_check

    model = tiny_models("llama")
    cuda = ("--device", "cuda", "--dtype", "float32", "--max-running-requests", "8")
    other = Server("decode", model, *cuda)
    try:
        kill_a_rank_and_check(model, Server("decode", model, "--tp-size", "2", *cuda), other, hf_device="cuda")
    finally:
        other.stop()
