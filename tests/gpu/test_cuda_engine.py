"""The engine on CUDA: parity with transformers, overlap == serial, no host sync in steady state,
and a timeline showing the host's work for batch N+1 overlapping the device's work for batch N."""

import random
import time

import numpy as np
import pytest
import torch

from pdserve.common.engine.engine import Engine
from pdserve.common.engine.overlap import PinnedStaging, staging_for
from pdserve.common.tiny_model import ARCHS
from pdserve.common.types import SamplingParams
from tests.test_disagg_engines import hf_greedy


def prompts(n, vocab=512, seed=0):
    rng = random.Random(seed)
    return [[0] + [rng.randrange(5, vocab) for _ in range(rng.randrange(1, 90))] for _ in range(n)]


@pytest.mark.parametrize("backend", ["triton", "torch_native"])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_on_cuda_agrees_with_transformers(arch, backend, tiny_models):
    """fp32 must be token-identical; bf16 is not exact: its agreement rates are reported.
    The triton backend replays decode from CUDA graphs (the default on CUDA)."""
    path = tiny_models(arch)
    cases = prompts(24)
    params = SamplingParams(max_new_tokens=16, temperature=0)
    expected = hf_greedy(path, cases, 16, device="cuda")
    engine = Engine(model_path=path, device="cuda", dtype="float32", max_total_tokens=16384, attention_backend=backend)
    assert (engine.runner.cuda_graphs is not None) == (backend == "triton")
    got = [c.output_ids for c in engine.generate(cases, params)]
    first = sum(g[:1] == e[:1] for g, e in zip(got, expected)) / len(cases)
    exact = sum(g == e for g, e in zip(got, expected)) / len(cases)
    print(f"\n{arch} {backend} fp32 cuda: first-token agreement {first:.2%}, whole-sequence agreement {exact:.2%}")
    assert exact == 1.0
    bf16 = Engine(model_path=path, device="cuda", dtype="bfloat16", max_total_tokens=16384, attention_backend=backend)
    got16 = [c.output_ids for c in bf16.generate(cases, params)]
    first16 = sum(g[:1] == e[:1] for g, e in zip(got16, expected)) / len(cases)
    top1 = sum(a == b for g, e in zip(got16, expected) for a, b in zip(g, e)) / sum(map(len, expected))
    print(f"{arch} {backend} bf16 cuda vs fp32 transformers: first-token {first16:.2%}, position-wise top-1 {top1:.2%}")
    assert first16 >= 0.75
    assert engine.is_idle() and bf16.is_idle()


def test_overlap_equals_serial_on_cuda(tiny_models):
    path = tiny_models("qwen3")
    cases = prompts(40, seed=1)
    params = [
        SamplingParams(max_new_tokens=24, temperature=0.0 if i % 2 else 0.9, seed=i, top_p=0.9) for i in range(40)
    ]
    kw = dict(
        model_path=path,
        device="cuda",
        dtype="float32",
        max_total_tokens=4096,
        max_running_requests=16,
        chunked_prefill_size=32,
        page_size=8,
    )
    serial = Engine(disable_overlap_schedule=True, **kw).generate(cases, params)
    overlap_engine = Engine(**kw)
    overlap = overlap_engine.generate(cases, params)
    assert [c.output_ids for c in overlap] == [c.output_ids for c in serial]
    assert overlap_engine.is_idle()


def strict(fn):
    """Run fn with every CUDA host sync an error."""

    def wrapped(*args, **kwargs):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return fn(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode(0)

    return wrapped


def test_steady_state_scheduling_never_syncs(tiny_models):
    """Scheduling, launching and result processing run under sync_debug_mode("error"); only
    `copy_done.synchronize()` (in EngineCore.process_batch_result, between those) waits for the device."""
    engine = Engine(
        model_path=tiny_models("llama"), device="cuda", max_total_tokens=8192, page_size=4, chunked_prefill_size=16
    )
    cases = prompts(16, seed=2)
    params = [SamplingParams(max_new_tokens=20, temperature=0.7, top_k=20, seed=i, logprobs=2) for i in range(16)]
    engine.generate(cases, params)  # warm-up: pinned-memory pools, kernels
    engine.scheduler.get_next_batch_to_run = strict(engine.scheduler.get_next_batch_to_run)
    engine.scheduler.process_batch_result = strict(engine.scheduler.process_batch_result)
    engine.run_batch = strict(engine.run_batch)
    outs = engine.generate(cases, params)
    assert all(len(o.output_ids) > 0 for o in outs) and engine.is_idle()
    # Every upload went through the pinned staging ring, and none had to wait for the device.
    ring = staging_for(torch.device("cuda"))
    assert ring.pending and ring.waits == 0


def test_pinned_staging_never_overwrites_bytes_a_queued_copy_has_not_read():
    ring = PinnedStaging(torch.device("cuda"), 1 << 16)
    torch.cuda._sleep(100_000_000)  # the stream is busy: every copy below queues behind this
    outs = [ring.upload(np.full(1024, i, dtype=np.int64)) for i in range(24)]  # 8 KiB each: the ring wraps
    assert ring.waits > 0  # the host waited for the copies of the regions it wrote again
    big = ring.upload(np.arange(1 << 14, dtype=np.int64))  # over a quarter of the ring: pinned on its own
    torch.cuda.synchronize()
    assert [int(o.min()) for o in outs] == [int(o.max()) for o in outs] == list(range(24))
    assert torch.equal(big.cpu(), torch.arange(1 << 14))


def test_timeline_host_work_for_n_plus_1_overlaps_device_work_for_n(tiny_models):
    # Eager decode: the test times each forward by wrapping runner.forward, which graphs bypass.
    engine = Engine(model_path=tiny_models("gpt2"), device="cuda", max_total_tokens=8192, disable_cuda_graph=True)
    spans = {}  # batch seq -> (device start event, device end event) of its forward

    def slow_forward(batch, ids, scored=None, forward=engine.runner.forward):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        # ~10 ms of device time per forward, so the device is the bottleneck (the torch-native
        # backend's kernel launches alone take the host ~3 ms per step on this tiny model)
        torch.cuda._sleep(20_000_000)
        logits = forward(batch, ids, scored)
        end.record()
        spans[batch.seq] = (start, end)
        return logits

    engine.runner.forward = slow_forward
    host = {}  # batch seq -> (host start, host end) of scheduling + launch
    busy_at_launch = []
    schedule, launch = engine.scheduler.get_next_batch_to_run, engine.run_batch
    state = {"t": 0.0, "last": None}

    def timed_schedule():
        state["t"] = time.perf_counter()
        return schedule()

    def timed_launch(batch):
        result = launch(batch)
        host[batch.seq] = (state["t"], time.perf_counter())
        if state["last"] is not None:
            busy_at_launch.append(not state["last"].published.query())  # N still running on the device?
        state["last"] = result
        return result

    engine.scheduler.get_next_batch_to_run, engine.run_batch = timed_schedule, timed_launch
    torch.cuda.synchronize()
    t0_event = torch.cuda.Event(enable_timing=True)
    t0_event.record()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    engine.generate(prompts(8, seed=3), SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True))
    torch.cuda.synchronize()
    rows = []
    for seq in sorted(host)[1:]:
        h_start, h_end = host[seq]
        g_start, g_end = spans[seq - 1]
        rows.append(
            (
                seq,
                (h_start - t0) * 1e3,
                (h_end - t0) * 1e3,
                t0_event.elapsed_time(g_start),
                t0_event.elapsed_time(g_end),
            )
        )
    print("\nbatch | host schedule+launch of N (ms) | device forward of N-1 (ms)")
    for seq, hs, he, gs, ge in rows:
        print(f"{seq:5d} | {hs:8.2f} .. {he:8.2f}          | {gs:8.2f} .. {ge:8.2f}")
    steady = busy_at_launch[2:]
    overlapped = sum(steady) / len(steady)
    print(f"host finished launching N+1 while N was still on the device: {overlapped:.0%} of {len(steady)} steps")
    assert overlapped >= 0.9
    # host-clock check of the same fact: launching N ended before forward N-1 ended on the device
    # (device times are relative to t0_event, recorded right before t0: same origin within ~0.1 ms)
    assert sum(he < ge for _, _, he, _, ge in rows[2:]) >= 0.9 * len(rows[2:])


def test_mem_fraction_static_sizes_the_kv_cache_from_measured_memory(tiny_models):
    engine = Engine(
        model_path=tiny_models("llama"), device="cuda", mem_fraction_static=0.05, max_running_requests=100000
    )
    pool = engine.runner.kv_pool
    kv_bytes = pool.capacity_tokens * pool.bytes_per_token()
    m = engine.runner.memory_report  # what the runner measured before sizing the pool
    print(
        f"\nmem_fraction_static 0.05 of {m['total'] / 2**30:.1f} GiB, {m['in_use'] / 2**30:.2f} GiB in use "
        f"(context, weights, earlier tests' leftovers): KV cache {kv_bytes / 2**30:.2f} GiB"
    )
    assert m["kv_budget"] == 0.05 * m["total"] - m["in_use"] > 0
    # The usable pool is the budget in whole pages (rounded up: at most one page over).
    page_bytes = pool.page_size * pool.bytes_per_token()
    assert m["kv_budget"] - page_bytes < kv_bytes <= m["kv_budget"] + page_bytes
    [out] = engine.generate([[0, 5, 6]], SamplingParams(max_new_tokens=3, temperature=0))
    assert len(out.output_ids) == 3


def test_cuda_graph_decode_equals_eager_decode(tiny_models):
    """Padded graph replays (batch sizes shrinking through 37 -> 1 as requests finish, with
    placeholders resolved inside the graph) give the eager kernels' tokens, overlap on and off."""
    path = tiny_models("llama")
    cases = prompts(37, seed=3)
    params = [SamplingParams(max_new_tokens=4 + i, temperature=0) for i in range(37)]
    kw = dict(model_path=path, device="cuda", dtype="float32", max_total_tokens=16384, attention_backend="triton")
    eager = Engine(disable_cuda_graph=True, **kw).generate(cases, params)
    for overlap in (True, False):
        engine = Engine(disable_overlap_schedule=not overlap, **kw)
        graphed = engine.generate(cases, params)
        assert engine.runner.cuda_graphs.replays > 30
        assert [c.output_ids for c in graphed] == [c.output_ids for c in eager]
        assert engine.is_idle()


@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen3"])
def test_prefill_cuda_graphs_agree_with_transformers(arch, tiny_models):
    """Prefills replayed from padded graphs: one prompt at a time, five at once, in 32-token
    chunks and over cached prefixes; fp32 tokens identical to transformers' and to the eager
    prefill's."""
    path = tiny_models(arch)
    cases = prompts(12, seed=5)
    expected = hf_greedy(path, cases, 6, device="cuda")
    params = SamplingParams(max_new_tokens=6, temperature=0)
    kw = dict(model_path=path, device="cuda", dtype="float32", max_total_tokens=16384, attention_backend="triton")
    for chunk in (8192, 32):
        engine = Engine(chunked_prefill_size=chunk, **kw)
        graphs = engine.runner.prefill_graphs
        assert graphs is not None and graphs.max_tokens <= chunk
        one_by_one = [engine.generate([ids], params)[0].output_ids for ids in cases]
        assert one_by_one == expected
        assert [c.output_ids for c in engine.generate(cases[:5], params)] == expected[:5]  # prefix hits
        assert graphs.replays >= len(cases) + 1
        assert engine.is_idle()
    eager = Engine(prefill_cuda_graph_max_tokens=0, **kw)
    assert eager.runner.prefill_graphs is None
    assert [c.output_ids for c in eager.generate(cases, params)] == expected
