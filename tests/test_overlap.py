"""The overlapped loop on CPU: same tokens as the serial loop, and the pipeline order it promises.

On CPU the streams and events are no-ops, so these tests pin down the ordering logic (placeholders,
late processing, discards, aborts); tests/gpu checks the real streams.
"""

import random

import numpy as np
import torch

from pdserve.common.engine.overlap import FutureMap, PinnedStaging
from pdserve.common.types import FinishReason, SamplingParams


def mixed_params(n):
    rng = random.Random(3)
    out = []
    for i in range(n):
        kind = i % 5
        if kind == 0:
            out.append(SamplingParams(max_new_tokens=rng.randint(3, 20), temperature=0))
        elif kind == 1:
            out.append(SamplingParams(max_new_tokens=rng.randint(3, 20), temperature=0.8, top_p=0.9, seed=i))
        elif kind == 2:
            out.append(
                SamplingParams(max_new_tokens=20, temperature=1.0, top_k=5, seed=i, logprobs=2, min_new_tokens=4)
            )
        elif kind == 3:
            out.append(
                SamplingParams(
                    max_new_tokens=16, temperature=0.7, seed=i, frequency_penalty=0.5, repetition_penalty=1.2
                )
            )
        else:
            out.append(SamplingParams(max_new_tokens=16, temperature=0, stop=("e",), ignore_eos=True))
    return out


PROMPTS = [f"prompt {i}: " + "lorem ipsum " * (i % 7) for i in range(24)]


def outputs(engine, params):
    return engine.generate(PROMPTS, params)


def assert_same(got, want):
    """Tokens, text and finish reason exactly; logprobs to float tolerance (batch shapes differ)."""
    for g, w in zip(got, want, strict=True):
        assert (g.output_ids, g.text, g.finish_reason) == (w.output_ids, w.text, w.finish_reason)
        assert (g.logprobs is None) == (w.logprobs is None)
        for a, b in zip(g.logprobs or [], w.logprobs or [], strict=True):
            assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4
            assert [t for t, _ in a.top] == [t for t, _ in b.top]


def test_overlap_and_serial_give_identical_outputs_for_every_sampling_feature(make_engine):
    params = mixed_params(len(PROMPTS))
    for arch in ("llama", "gpt2"):
        settings = dict(max_running_requests=8, chunked_prefill_size=12, page_size=4)
        serial = outputs(make_engine(arch, disable_overlap_schedule=True, **settings), params)
        overlap = outputs(make_engine(arch, **settings), params)
        assert_same(overlap, serial)
        assert all(t >= 0 for c in overlap for t in c.output_ids), "a placeholder leaked into the output"


def test_overlap_launches_batch_n_before_processing_batch_n_minus_1(make_engine):
    engine = make_engine("qwen3")
    engine.generate(["a", "b", "c"], SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True))
    trace = list(engine.trace)
    launches = [b for op, b in trace if op == "launch"]
    assert len(launches) == 12  # one prefill, then 11 decode steps
    for earlier, later in zip(launches, launches[1:]):
        # batch `later` is launched while batch `earlier` is still unprocessed
        assert trace.index(("launch", later)) < trace.index(("process", earlier))
    serial = make_engine("qwen3", disable_overlap_schedule=True)
    serial.generate(["a", "b", "c"], SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True))
    ops = [op for op, _ in serial.trace]
    assert ops == ["launch", "process"] * 12


def test_penalties_and_consecutive_prefills_run_serially(make_engine):
    engine = make_engine("llama", serial_consecutive_prefill=True, max_prefill_tokens=8)
    engine.generate(["one two three", "four five six"], SamplingParams(max_new_tokens=2, temperature=0))
    ops = [op for op, _ in engine.trace]
    assert ops[:4] == ["launch", "process", "launch", "process"]  # prefill, prefill: serial
    engine = make_engine("llama")
    engine.generate(["x"], SamplingParams(max_new_tokens=6, temperature=0.5, seed=1, presence_penalty=1.0))
    assert [op for op, _ in engine.trace] == ["launch", "process"] * 6


def test_aborts_at_random_steps_with_tokens_in_flight(make_engine):
    params = mixed_params(len(PROMPTS))
    reference = make_engine("mistral", disable_overlap_schedule=True).generate(PROMPTS, params)
    for overlap in (True, False):
        engine = make_engine("mistral", disable_overlap_schedule=not overlap, max_running_requests=6, page_size=4)
        rng = random.Random(11)
        rids = [engine.add_request(engine.tokenizer(p)["input_ids"], sp) for p, sp in zip(PROMPTS, params)]
        doomed = set(rng.sample(rids, 8))
        abort_at = {rid: rng.randrange(1, 30) for rid in doomed}
        schedule = engine.scheduler.get_next_batch_to_run
        iteration = [0]

        def schedule_with_aborts():
            iteration[0] += 1
            for rid, when in abort_at.items():
                if when == iteration[0]:
                    aborted.append(engine.abort(rid))
            return schedule()

        aborted = []
        engine.scheduler.get_next_batch_to_run = schedule_with_aborts
        done = {c.rid: c for c in engine.run_loop()}
        for c in aborted:
            if c is not None:
                done.setdefault(c.rid, c)
        assert set(done) == set(rids)
        for rid, ref in zip(rids, reference):
            got = done[rid]
            if got.finish_reason is FinishReason.ABORT:
                assert rid in doomed and got.output_ids == ref.output_ids[: len(got.output_ids)]
            else:
                assert got.output_ids == ref.output_ids and got.text == ref.text
        assert engine.is_idle()


def test_future_map_slots_wrap_and_resolve():
    fm = FutureMap(max_batch=2, device=torch.device("cpu"))  # 10 slots, slot 0 unused
    assert fm.alloc(3) == [1, 2, 3] and fm.alloc(4) == [4, 5, 6, 7] and fm.alloc(3) == [1, 2, 3]
    fm.store([1, 2, 3], torch.tensor([70, 80, 90]))
    assert fm.resolve(torch.tensor([5, -2, 6, -3, -1])).tolist() == [5, 80, 6, 90, 70]


class FakeCopyEvent:
    """A CUDA event stand-in: complete once the test says so (or once waited for)."""

    def __init__(self):
        self.complete, self.waited = False, 0

    def record(self):
        self.complete = False

    def query(self):
        return self.complete

    def synchronize(self):
        self.waited += 1
        self.complete = True


def fake_staging(nbytes):
    events = []

    def new_event():
        events.append(FakeCopyEvent())
        return events[-1]

    return PinnedStaging(torch.device("cpu"), nbytes, pin=False, new_event=new_event), events


def test_pinned_staging_uploads_keep_values_dtypes_and_shapes():
    ring, _ = fake_staging(4096)
    for array in (
        np.arange(7, dtype=np.int64),
        np.ones((2, 3), dtype=np.int32),
        np.array([True, False]),
        np.linspace(0, 1, 5, dtype=np.float32),
        np.zeros((0, 4), dtype=np.int64),
        np.arange(12, dtype=np.int64).reshape(3, 4)[:, 1],
    ):  # (a strided view)
        out = ring.upload(array)
        assert out.dtype == torch.from_numpy(array).dtype and out.shape == array.shape
        assert np.array_equal(out.numpy(), array)
    assert ring.head % PinnedStaging.ALIGN == 0


def test_pinned_staging_reuses_a_region_only_after_its_copy_ran():
    ring, events = fake_staging(1024)  # four 256-byte regions
    first = [ring.upload(np.full(32, i, dtype=np.int64)) for i in range(4)]
    assert ring.waits == 0 and len(ring.pending) == 4
    # The ring is full of copies still queued: the next upload must wait for the oldest, only it.
    ring.upload(np.full(32, 9, dtype=np.int64))
    assert ring.waits == 1 and [e.waited for e in events] == [1, 0, 0, 0, 0]
    # Copies that ran free their regions without a wait, and their events are used again.
    for i in range(8):
        for event in events:
            event.complete = True  # the device keeps up
        ring.upload(np.full(32, i, dtype=np.int64))
    assert ring.waits == 1 and len(events) == 5
    assert [t[0].item() for t in first] == [0, 1, 2, 3]  # device copies own their bytes
