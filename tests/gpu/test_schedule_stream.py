"""Every device op that scheduling issues runs on schedule_stream (docs/architecture.md, "The overlapped loop").

A TorchDispatchMode sees every aten op of the loop's iterations except those inside the runner's
launch (forward, sampling, the D2H copies: the forward and D2H streams' work) and records the
current stream of each op that touches a CUDA tensor. On a decode engine whose KV "arrives" (its
notifications are played by the test) and on the colocated engine (prefix hits, chunks: the
prefill server schedules with the same parts), all of them must be on schedule_stream: the
req_to_token rows of arrived KV and of prefix hits, the batch's slots and uploads, the sampling
tensors. The recorder itself is checked first: a write
issued on another stream is caught.
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pdserve.common.config import EngineConfig
from pdserve.common.engine.engine import Engine
from pdserve.common.kv_transfer import encode_notif
from pdserve.common.scheduling.pages import pages_for
from pdserve.common.types import SamplingParams
from pdserve.decode.engine import DecodeEngine


def _cuda(value) -> bool:
    if isinstance(value, torch.Tensor):
        return value.is_cuda
    if isinstance(value, (list, tuple)):
        return any(_cuda(v) for v in value)
    return False


class StreamRecorder(TorchDispatchMode):
    """(op, stream) of every CUDA op outside the runner's launch."""

    def __init__(self, runner):
        super().__init__()
        self.ops, self.paused = [], 0
        launch = runner.launch

        def unrecorded_launch(*args, **kwargs):
            self.paused += 1
            try:
                return launch(*args, **kwargs)
            finally:
                self.paused -= 1

        runner.launch = unrecorded_launch

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.paused and (_cuda(args) or _cuda(list((kwargs or {}).values())) or _cuda(out)):
            self.ops.append((str(func), torch.cuda.current_stream()))
        return out

    def off_stream(self, stream) -> list[str]:
        return [op for op, s in self.ops if s != stream]


def config(path, **kw):
    return EngineConfig(model_path=path, device="cuda", dtype="float32", max_total_tokens=8192, page_size=4, **kw)


def step(engine, loop, recorder, steps=1):
    out = []
    for _ in range(steps):
        with recorder:
            out += next(loop)
    return out


def test_the_recorder_catches_a_write_on_another_stream(tiny_models):
    engine = Engine(config(tiny_models("llama")))
    recorder = StreamRecorder(engine.runner)
    pool = engine.runner.req_to_token_pool
    with recorder, torch.cuda.stream(torch.cuda.default_stream()):
        pool.write_slots(
            torch.tensor([0], device="cuda"), torch.tensor([0], device="cuda"), torch.tensor([1], device="cuda")
        )
    assert recorder.off_stream(engine.streams.schedule_stream), "a default-stream write went unnoticed"


@pytest.mark.parametrize("overlap", [True, False])
def test_decode_arrivals_and_batches_are_written_on_the_schedule_stream(tiny_models, overlap):
    engine = DecodeEngine(config(tiny_models("llama"), disable_overlap_schedule=not overlap), "decode-streams")
    recorder = StreamRecorder(engine.runner)
    params = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)
    rooms = {f"r{i}": 1000 + i for i in range(4)}
    pages = {}
    for i, (rid, room) in enumerate(rooms.items()):
        prompt = [0] + list(range(5, 12 + 3 * i))
        engine.add_decode_request(prompt, params, room, rid=rid)
        pages[room] = pages_for(len(prompt), engine.config.page_size)
    # The prefill server's notifications, played: the KV pages hold zeros, which is all this test
    # needs (it checks streams, not tokens).
    arrived = [
        ("prefill", encode_notif(room, 7, None, n, engine.agent.layout.transfer_bytes(n))) for room, n in pages.items()
    ]
    engine.agent.get_notifs = lambda: [arrived.pop()] if arrived else []
    loop = engine.event_loop()
    done = []
    for _ in range(200):
        done += step(engine, loop, recorder)
        if len(done) == len(rooms) and not engine.busy():
            break
    assert sorted(c.rid for c in done) == sorted(rooms) and all(len(c.output_ids) == 6 for c in done)
    assert any("index_put" in op for op, _ in recorder.ops), "no req_to_token write was seen"
    assert recorder.off_stream(engine.streams.schedule_stream) == []
    assert engine.is_idle()


def test_colocated_prefix_hits_and_chunks_are_written_on_the_schedule_stream(tiny_models):
    engine = Engine(config(tiny_models("qwen3"), chunked_prefill_size=16))
    recorder = StreamRecorder(engine.runner)
    shared = list(range(5, 45))
    params = SamplingParams(max_new_tokens=5, temperature=0)
    engine.generate([[0] + shared], params)  # fills the prefix cache
    for i in range(3):
        engine.add_request([0] + shared + [50 + i] * (i + 1), params)
    loop, done = engine.event_loop(), []
    while engine.busy():
        done += step(engine, loop, recorder)
    assert len(done) == 3 and sum(c.cached_tokens for c in done) > 0
    assert recorder.off_stream(engine.streams.schedule_stream) == []
