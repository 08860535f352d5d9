"""Speculative decoding on CUDA: verify steps replayed from their CUDA graphs
(common/engine/speculative/verify_graph.py) between plain decode steps replayed from the decode graphs, on
the overlap loop's streams. fp32 greedy equals transformers and the plain engine, seeded sampling equals
the plain engine, colocated and on a decode server whose KV came by NIXL; a replayed verify step's logits
equal the eager verify forward's of the same batch; verify steps larger than the graphs run eagerly, with
the same tokens."""

import pytest
import torch

from pdserve.common.config import EngineConfig
from pdserve.common.engine.engine import Engine
from pdserve.common.engine.speculative.verify_graph import verify_capture_sizes
from pdserve.common.speculation import SPECULATIVE_MAX_BATCH
from pdserve.common.types import SamplingParams
from pdserve.decode.engine import DecodeEngine
from pdserve.prefill.engine import PrefillEngine
from tests.test_disagg_engines import drive, hf_greedy
from tests.test_speculative_engine import PROMPTS, Oracle, assert_speculated, spec_stats, watch

CUDA = dict(device="cuda", dtype="float32", max_total_tokens=8192, page_size=16)


def eager_verify_steps(engine) -> list[int]:
    """The batch sizes of the verify forwards the engine runs eagerly from now on (a graph replay
    never calls runner.forward)."""
    runner, eager = engine.runner, []
    forward = runner.forward

    def counted(batch, *args, **kwargs):
        if batch.verify:
            eager.append(batch.batch_size)
        return forward(batch, *args, **kwargs)

    runner.forward = counted
    return eager


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt2"])
def test_verify_steps_replay_their_graphs_and_give_the_plain_tokens(tiny_models, arch, overlap):
    path = tiny_models(arch)
    greedy = SamplingParams(max_new_tokens=24, temperature=0)
    sampled = SamplingParams(max_new_tokens=24, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True)
    expected = hf_greedy(path, PROMPTS, 24, device="cuda")
    plain_engine = Engine(model_path=path, disable_overlap_schedule=not overlap, **CUDA)
    assert plain_engine.runner.cuda_graphs is not None and plain_engine.runner.verify_graphs is None
    plain = plain_engine.generate(PROMPTS, greedy)
    plain_sampled = plain_engine.generate(PROMPTS, sampled)
    assert [c.output_ids for c in plain] == expected

    engine = Engine(model_path=path, speculative="ngram", disable_overlap_schedule=not overlap, **CUDA)
    graphs = engine.runner.verify_graphs
    # (--max-running-requests 256: the decode graphs' largest batch is 256; verify stops at the policy's limit)
    assert graphs is not None and graphs.sizes == verify_capture_sizes(min(256, SPECULATIVE_MAX_BATCH), 5)
    assert len(graphs.graphs) == len(graphs.sizes)
    eager = eager_verify_steps(engine)
    assert [c.output_ids for c in engine.generate(PROMPTS, greedy)] == expected
    assert_speculated(engine)
    assert graphs.replays == spec_stats(engine)["spec_verify_steps"] and eager == []

    engine.scheduler.speculation.proposer = Oracle(PROMPTS, plain_sampled)
    watch(engine)
    steps = spec_stats(engine)["spec_verify_steps"]
    replays = graphs.replays
    assert [c.output_ids for c in engine.generate(PROMPTS, sampled)] == [c.output_ids for c in plain_sampled]
    assert graphs.replays - replays == spec_stats(engine)["spec_verify_steps"] - steps > 0 and eager == []
    assert engine.runner.cuda_graphs.replays > 0  # the plain decode steps between them
    assert engine.is_idle()


def test_a_replayed_verify_step_gives_the_eager_verify_logits(tiny_models):
    """Each replay's logits [n, vocab] against runner.forward of the same batch (fp32; the padded GEMMs
    may pick other kernels than the unpadded ones: equal to rounding)."""
    path = tiny_models("llama")
    # Requests of different lengths: near their ends they take fewer drafts than k, so the verify
    # steps' token counts fall between the captured sizes (padded replays). (At one length for all,
    # an H200 run saw every step land on a captured size.)
    greedy = [SamplingParams(max_new_tokens=24 - 3 * i, temperature=0, ignore_eos=True) for i in range(len(PROMPTS))]
    plain = Engine(model_path=path, **CUDA).generate(PROMPTS, greedy)
    engine = Engine(model_path=path, speculative="ngram", **CUDA)
    engine.scheduler.speculation.proposer = Oracle(PROMPTS, plain)
    runner, graphs = engine.runner, engine.runner.verify_graphs
    replay, compared = graphs.replay, []

    def checked(batch):
        eager = runner.forward(batch, batch.input_ids).clone()  # (writes the KV the replay writes again)
        logits = replay(batch)
        assert logits.shape == eager.shape == (batch.num_tokens, engine.vocab_size)
        torch.testing.assert_close(logits, eager, rtol=1e-4, atol=1e-4)
        compared.append(batch.num_tokens)
        return logits

    graphs.replay = checked
    assert [c.output_ids for c in engine.generate(PROMPTS, greedy)] == [c.output_ids for c in plain]
    assert_speculated(engine)
    assert len(compared) == spec_stats(engine)["spec_verify_steps"]
    assert any(n not in graphs.sizes for n in compared)  # padded replays among them


def test_verify_steps_beyond_the_graphs_run_eagerly(tiny_models):
    """Decode graphs up to 2 requests, no speculation limit: verify steps of 3 or 4 requests run eagerly
    (the warm-up compiled their shapes), those of 1 or 2 replay; greedy is transformers' either way."""
    path = tiny_models("qwen3")
    expected = hf_greedy(path, PROMPTS, 24, device="cuda")
    engine = Engine(model_path=path, speculative="ngram", speculative_max_batch=0, cuda_graph_max_bs=2, **CUDA)
    graphs = engine.runner.verify_graphs
    assert graphs.sizes == [5, 10]
    plain = Engine(model_path=path, **CUDA).generate(PROMPTS, SamplingParams(max_new_tokens=24, temperature=0))
    engine.scheduler.speculation.proposer = Oracle(PROMPTS, plain)
    eager = eager_verify_steps(engine)
    outs = engine.generate(PROMPTS, [SamplingParams(max_new_tokens=n, temperature=0) for n in (8, 16, 20, 24)])
    assert [c.output_ids for c in outs] == [e[:n] for e, n in zip(expected, (8, 16, 20, 24))]
    assert_speculated(engine)
    assert eager and max(eager) == 4 and min(eager) >= 3 and graphs.replays > 0
    assert graphs.replays + len(eager) == spec_stats(engine)["spec_verify_steps"]


def test_a_decode_server_speculates_on_kv_written_by_nixl_on_cuda(tiny_models):
    path = tiny_models("qwen3")
    expected = hf_greedy(path, PROMPTS, 24, device="cuda")
    spec = EngineConfig(model_path=path, speculative="ngram", **CUDA)  # (the prefill server ignores the flag)
    prefill = PrefillEngine(spec, "prefill-cuda-spec", kv_transfer_timeout=30)
    decode = DecodeEngine(spec, "decode-cuda-spec", kv_transfer_timeout=30)
    completions, _ = drive(prefill, decode, PROMPTS, [SamplingParams(max_new_tokens=24, temperature=0)] * 4)
    assert [completions[f"r{i}"].output_ids for i in range(len(PROMPTS))] == expected
    assert_speculated(decode)
    assert decode.runner.verify_graphs.replays == spec_stats(decode)["spec_verify_steps"]
    assert prefill.runner.verify_graphs is None  # (a prefill server never speculates)
    assert decode.is_idle() and prefill.is_idle()
