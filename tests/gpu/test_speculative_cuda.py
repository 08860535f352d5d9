"""Speculative decoding on CUDA: verify steps replayed from their CUDA graphs
(common/engine/speculative/verify_graph.py) between plain decode steps replayed from the decode graphs, on
the overlap loop's streams. fp32 greedy equals transformers and the plain engine, seeded sampling equals
the plain engine, colocated and on a decode server whose KV came by NIXL; a replayed verify step's logits
equal the eager verify forward's of the same batch; verify steps larger than the graphs run eagerly, with
the same tokens. The draft-model proposer (--speculative draft) on CUDA: the draft model fused, its one-token
draft forwards replayed from its own CUDA graphs (on its own stream, beside the target's graphs), the
target itself (every draft accepted) or another model of its vocabulary as the draft model, greedy equal to
transformers, both KV pools idle afterwards."""

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
from tests.test_speculative_draft import acceptance, other_draft, watch_drafts  # noqa: F401 (other_draft: a fixture)
from tests.test_speculative_engine import PROMPTS, Oracle, assert_speculated, spec_stats, watch

CUDA = dict(device="cuda", dtype="float32", max_total_tokens=8192, page_size=16, speculative_overlap="on")


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
    checked = watch(engine)
    assert [c.output_ids for c in engine.generate(PROMPTS, greedy)] == expected
    assert spec_stats(engine)["spec_proposed_tokens"] > 0  # (n-gram on random weights: seldom accepted)
    assert graphs.replays == checked["verify_batches"] and eager == []

    # Overlapped (greedy, drafts that guess the token in flight): positions moved on the device, replayed.
    engine.scheduler.speculation.proposer = Oracle(PROMPTS, plain)
    replays, batches = graphs.replays, checked["verify_batches"]
    assert [c.output_ids for c in engine.generate(PROMPTS, greedy)] == expected
    assert_speculated(engine)
    assert graphs.replays - replays == checked["verify_batches"] - batches > 0 and eager == []
    assert (checked["moved"] > 0) == overlap

    # Sampled (top_p, seeded): overlapped too, the noise keys made again on the device.
    engine.scheduler.speculation.proposer = Oracle(PROMPTS, plain_sampled)
    sampled_seen = watch(engine)
    replays = graphs.replays
    assert [c.output_ids for c in engine.generate(PROMPTS, sampled)] == [c.output_ids for c in plain_sampled]
    assert graphs.replays - replays == sampled_seen["verify_batches"] > 0 and eager == []
    assert (sampled_seen["moved"] > 0) == overlap
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
    seen = watch(engine)
    assert [c.output_ids for c in engine.generate(PROMPTS, greedy)] == [c.output_ids for c in plain]
    assert_speculated(engine)
    assert len(compared) == seen["verify_batches"]
    assert any(n not in graphs.sizes for n in compared)  # padded replays among them
    assert seen["moved"] > 0  # overlapped: lengths the graph read from the device


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
    seen = watch(engine)
    outs = engine.generate(PROMPTS, [SamplingParams(max_new_tokens=n, temperature=0) for n in (8, 16, 20, 24)])
    assert [c.output_ids for c in outs] == [e[:n] for e, n in zip(expected, (8, 16, 20, 24))]
    assert_speculated(engine)
    assert eager and max(eager) == 4 and min(eager) >= 3 and graphs.replays > 0
    assert graphs.replays + len(eager) == seen["verify_batches"]


def test_a_decode_server_speculates_on_kv_transferred_on_cuda(tiny_models):
    path = tiny_models("qwen3")
    expected = hf_greedy(path, PROMPTS, 24, device="cuda")
    spec = EngineConfig(model_path=path, speculative="ngram", **CUDA)  # (the prefill server ignores the flag)
    prefill = PrefillEngine(spec, "prefill-cuda-spec", kv_transfer_timeout=30)
    decode = DecodeEngine(spec, "decode-cuda-spec", kv_transfer_timeout=30)
    seen = watch(decode)
    completions, _ = drive(prefill, decode, PROMPTS, [SamplingParams(max_new_tokens=24, temperature=0)] * 4)
    assert [completions[f"r{i}"].output_ids for i in range(len(PROMPTS))] == expected
    assert spec_stats(decode)["spec_proposed_tokens"] > 0  # (n-gram on random weights: seldom accepted)
    assert decode.runner.verify_graphs.replays == seen["verify_batches"] > 0
    assert prefill.runner.verify_graphs is None  # (a prefill server never speculates)
    assert decode.is_idle() and prefill.is_idle()


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_draft_model_speculation_gives_the_plain_tokens_under_cuda_graphs(tiny_models, other_draft, arch, overlap):  # noqa: F811
    """--speculative draft with CUDA graphs: the target as its own draft model (every draft accepted) and
    another model of its vocabulary (some rejected), overlap on and off: transformers' greedy tokens, the
    plain engine's; every verify step a graph replay; the draft model fused as the target is, and every
    DECODE draft forward (the feed-backs, the one-token catch-ups) a replay of the draft model's graphs; the
    draft KV rolled back after each verify step and both KV pools (the target's, the draft model's) idle once
    the requests are done. Prompts past 16 tokens reach the draft model in chunks of 16 (--chunked-prefill-size)."""
    path = tiny_models(arch)
    greedy = SamplingParams(max_new_tokens=24, temperature=0)
    expected = hf_greedy(path, PROMPTS, 24, device="cuda")
    plain = Engine(model_path=path, disable_overlap_schedule=not overlap, **CUDA).generate(PROMPTS, greedy)
    assert [c.output_ids for c in plain] == expected
    for draft in (path, other_draft(arch)):
        engine = Engine(
            model_path=path,
            speculative="draft",
            draft_model_path=draft,
            disable_overlap_schedule=not overlap,
            chunked_prefill_size=16,
            **CUDA,
        )
        graphs, proposer = engine.runner.verify_graphs, engine.proposer
        assert graphs is not None and proposer.runner.device.type == "cuda"
        assert proposer.is_idle()  # (its start-up warm-up freed what it drafted for)
        draft_runner = proposer.runner
        assert all(hasattr(layer.self_attn, "qkv_proj") for layer in draft_runner.model.model.layers)  # fused
        draft_graphs = draft_runner.graphs
        assert draft_graphs is not None and draft_graphs.max_bs == draft_runner.req_to_token_pool.size
        assert draft_graphs.pool != engine.runner.cuda_graphs.pool  # (the target's may run meanwhile)
        replays, decodes = draft_graphs.replays, draft_runner.decode_forwards
        checked, drafts, eager = watch(engine), watch_drafts(engine), eager_verify_steps(engine)
        streams, forward = [], draft_runner.decode

        def on_stream(*args):
            streams.append(torch.cuda.current_stream())
            return forward(*args)

        draft_runner.decode = on_stream
        assert [c.output_ids for c in engine.generate(PROMPTS, greedy)] == expected, (draft, overlap)
        stats = spec_stats(engine)
        # Every draft forward on the draft model's own stream (not behind the target's step in flight), and
        # with overlap on, verify steps proposed while the one before ran
        assert streams and all(s == draft_runner.stream for s in streams)
        assert draft_runner.stream not in (engine.streams.schedule_stream, engine.streams.forward_stream)
        assert (stats["spec_overlapped_steps"] > 0) == overlap, stats
        assert_speculated(engine)
        assert checked["verify_steps"] == stats["spec_verify_steps"] and drafts["checked"] > 0
        assert graphs.replays == checked["verify_batches"] and eager == []  # (with drafts, or moved by the step before)
        assert max(drafts["forward_tokens"]) == 16
        assert draft_graphs.replays - replays == draft_runner.decode_forwards - decodes == len(drafts["decodes"]) > 0
        if draft == path:  # (every guess holds: only drafts of steps whose request had finished go unjudged)
            assert acceptance(engine) > 0.95, stats
            assert stats["spec_unconfirmed_tokens"] == checked["dropped_drafts"], (stats, checked)
        else:
            assert 0 < stats["spec_accepted_tokens"] < stats["spec_proposed_tokens"], stats
            assert any(not on_device for _, on_device in drafts["decodes"])  # one-token catch-ups replayed too
        rows, pool = proposer.runner.req_to_token_pool, proposer.runner.kv_pool
        assert not proposer.states and rows.available() == rows.size
        assert pool.num_free_pages() == pool.capacity_pages
        assert engine.is_idle(), engine.stats()
