"""CUDA graphs for verify steps (common/engine/speculative/verify_graph.py), on CPU: the graph runner's
padded forward run eagerly (`capture=False`; capture itself needs a GPU: tests/gpu/test_speculative_cuda.py)
through the Triton kernels in Triton's interpreter. Each padded verify forward gives the logits of the
unpadded eager verify forward of the same batch (to rounding) and its tokens, and the engine's tokens stay
the plain engine's and transformers'."""

import pytest
import torch

from pdserve.common.engine.prefill_graph import PrefillGraphRunner
from pdserve.common.engine.speculative.verify_graph import VerifyGraphRunner, verify_capture_sizes
from pdserve.common.types import SamplingParams
from tests.test_disagg_engines import hf_greedy
from tests.test_speculative_engine import PROMPTS, Oracle, assert_speculated, watch


def test_verify_capture_sizes_follow_the_decode_batch_sizes():
    for max_bs, positions in ((1, 2), (3, 5), (8, 5), (32, 5), (37, 3), (256, 5)):
        sizes = verify_capture_sizes(max_bs, positions)
        assert sizes == sorted(set(sizes)) and sizes[0] == positions and sizes[-1] == max_bs * positions
        assert all(s % positions == 0 for s in sizes)
        # a verify step of b requests (b to b * positions tokens) pads to at most a decode graph's padding
        for n in range(1, max_bs * positions + 1):
            padded = next(s for s in sizes if s >= n)
            assert padded - n < positions * max(16, -(-n // positions))


def test_the_padded_verify_forward_gives_the_eager_verify_logits_and_tokens(make_engine, tiny_models):
    """Verify steps of 2 requests, then 1 (4 drafts at most, some rejected), replay the verify runner's
    padded forward: tokens padded up to the captured count, an unused request slot. Prefill batches never
    go to it, nor verify batches to the prefill runner."""
    arch, max_new = "qwen3", [8, 16]
    prompts = PROMPTS[:2]
    params = [SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True) for n in max_new]
    base = dict(page_size=4, chunked_prefill_size=16, max_total_tokens=4096, speculative_overlap="on")
    plain = make_engine(arch, **base).generate(prompts, params)  # (torch_native: the interpreter is slow)
    expected = hf_greedy(tiny_models(arch), prompts, max(max_new))
    for c, e, n in zip(plain, expected, max_new):  # (transformers stops at EOS; ignore_eos runs on)
        assert c.output_ids[: len(e)] == e[:n]

    engine = make_engine(arch, speculative="ngram", attention_backend="triton", **base)
    engine.scheduler.speculation.proposer = Oracle(prompts, plain)
    runner = engine.runner
    graphs = VerifyGraphRunner(runner, max_bs=2, positions=5, capture=False)
    assert graphs.sizes == [5, 10] and graphs.num_slots(5) == 3 and graphs.num_slots(10) == 3
    prefill_graphs = PrefillGraphRunner(runner, max_tokens=32, max_reqs=3, capture=False)
    runner.verify_graphs, runner.prefill_graphs = graphs, prefill_graphs
    padded = []
    replay, prefill_replay, forward = graphs.replay, prefill_graphs.replay, runner.forward

    def checked_replay(batch):
        assert batch.verify
        eager = forward(batch, batch.input_ids).clone()  # (writes the same KV the padded forward writes)
        logits = replay(batch)
        assert logits.shape == eager.shape == (batch.num_tokens, engine.vocab_size)
        # (equal to rounding: a CPU GEMM's rows depend on its row count, 10 padded rows or 6, by ~1e-6)
        torch.testing.assert_close(logits, eager, rtol=0, atol=1e-4)
        assert torch.equal(logits.argmax(dim=-1), eager.argmax(dim=-1))
        padded.append((batch.num_tokens, batch.batch_size))
        return logits

    def checked_prefill_replay(batch):
        assert not batch.verify
        return prefill_replay(batch)

    graphs.replay, prefill_graphs.replay = checked_replay, checked_prefill_replay
    checked = watch(engine)
    assert [c.output_ids for c in engine.generate(prompts, params)] == [c.output_ids for c in plain]
    assert_speculated(engine)
    assert graphs.replays == len(padded) > 0 and prefill_graphs.replays > 0
    assert len(padded) == checked["verify_batches"] and {b for _, b in padded} == {1, 2}
    assert checked["overlapped"] > 0  # (positions moved on the device: the graph read the device's lengths)
    assert any(n not in graphs.sizes for n, _ in padded)  # token padding (fewer than 4 drafts for someone)
    assert any(b == 1 for _, b in padded)  # an unused request slot


@pytest.mark.parametrize("keep_all", [False, True])
def test_each_runner_takes_only_its_own_batches(make_engine, keep_all):
    """A verify batch never replays a prefill graph (it would return each request's last logits only),
    and a prefill batch never replays a verify graph; nor one of more requests than its graphs hold."""
    engine = make_engine("llama", attention_backend="triton", max_total_tokens=4096)
    runner = engine.runner
    if keep_all:
        graphs = VerifyGraphRunner(runner, max_bs=4, positions=5, capture=False)
    else:
        graphs = PrefillGraphRunner(runner, max_tokens=32, max_reqs=4, capture=False)
    batch = runner._dummy_extend([5, 5])
    batch.packed = torch.stack([batch.input_ids, batch.positions, batch.out_cache_loc])
    for verify in (False, True):
        batch.verify = verify
        assert graphs.can_run(batch) == (verify == keep_all)
    batch = runner._dummy_extend([1] * 5)  # 5 requests: more than 4
    batch.packed = torch.stack([batch.input_ids, batch.positions, batch.out_cache_loc])
    batch.verify = keep_all
    assert not graphs.can_run(batch)


def test_the_warm_up_runs_an_eager_verify_step(make_engine):
    """Verify steps beyond the graphs run eagerly: the warm-up runs one (every position's logits, sampled),
    so their kernels are compiled before the first request (on CUDA; here the same calls on CPU)."""
    runner = make_engine("llama", speculative="ngram", num_speculative_tokens=3).runner
    seen, forward = [], runner.forward

    def recorded(batch, *args, **kwargs):
        logits = forward(batch, *args, **kwargs)
        seen.append((batch.verify, batch.num_tokens, batch.batch_size, logits.shape[0]))
        return logits

    runner.forward = recorded
    runner.warmup(64)
    assert [s for s in seen if s[0]] == [(True, 12, 3, 12)]  # 3 requests of 1 + 3 positions, every one's logits
    assert len(seen) > 1 and all(rows == b for verify, _, b, rows in seen if not verify)  # (the others: the last)
